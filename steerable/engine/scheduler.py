"""Token-budget scheduler (vLLM v1 style): no prefill or decode phase, only catching up.

Each step every running request asks for ``num_tokens - num_computed_tokens`` tokens (one for a
decode, a chunk for a prefill), running requests first, then waiting ones, until the token budget
or the sequence cap is spent. When blocks run out the newest running request is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue.

On a pipeline, M micro-batches are in flight at once (at least one per stage), and a request
whose sampled token is still on its way (from the last stage) cannot run again yet. The running
requests are therefore split into batches of at most ``ceil(running / M)``: every micro-batch gets
a similar share, and a batch that happens to hold most requests is split up instead of leaving
the stages idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from steerable.engine.kv_cache import KVCacheManager
from steerable.request import Request, RequestStatus, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 cache_limit: Callable[[Request], int] | None = None, micro_batches: int = 1):
        """``cache_limit(request, hit_tokens)`` caps how many leading tokens of a prefix-cache hit
        the request takes (capture asks to recompute prompt rows it must see and cannot get from
        its activation store). ``micro_batches`` > 1: a pipeline's batches in flight."""
        self.kv = kv
        self.micro_batches = micro_batches
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.cache_limit = cache_limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Admits the next queued request into ``waiting`` when it runs dry (False: none is queued).
        self.refill: Callable[[], bool] = lambda: False
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        block_size = self.kv.block_size
        pipelined = self.micro_batches > 1
        batch = -(-len(self.running) // self.micro_batches)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < batch:
            request = self.running[i]
            if request.num_pending and (pipelined or self._done_after_pending(request)):
                i += 1  # its token is in flight: on a pipeline it waits; else nothing is left to compute
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Most decode steps fit in the request's last block: skip the allocator (sliding-window
            # groups hand back blocks there, so they do it when the request next takes a block).
            fits = request.num_computed_tokens + num_new <= len(request.block_ids[0]) * block_size
            while not fits and not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing smaller is left to evict

        while not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs and (
                self.waiting or self.refill()):
            request = self.waiting[0]
            if request.num_pending:  # preempted with a token in flight: resume once it has arrived
                break
            cached, num_cached = self.kv.find_cached_prefix(request, request.num_tokens - 1)
            if num_cached and self.cache_limit is not None:
                limit = self.cache_limit(request, num_cached)
                if limit < num_cached:
                    cached, num_cached = self.kv.find_cached_prefix(request, limit)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            self.kv.record_lookup(request.num_tokens, num_cached)
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return out

    def _done_after_pending(self, request: Request) -> bool:
        return (request.num_output_tokens >= request.params.max_tokens
                or request.num_tokens >= self.max_model_len)

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new, request.num_computed_tokens + num_new == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def pause(self, request: Request) -> None:
        """A streaming-input chunk is done: leave the queues, keep the blocks for the next chunk."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.PAUSED

    def resume(self, request: Request) -> None:
        """The next chunk is applied: with its blocks the request runs on (the caller keeps the
        sequence cap); preempted while it ran, it waits to be prefilled again."""
        if request.block_ids:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Drop a request from the queues and give its blocks back (finished or aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED

    def finish_all(self, requests: list[Request]) -> None:
        """``finish`` each of ``requests`` (an aborted group's samples) with one pass over each
        queue, so an abort costs the queues' length, not that times the number aborted."""
        if len(requests) == 1:
            self.finish(requests[0])
            return
        gone = {id(r) for r in requests}
        if any(r.status is RequestStatus.RUNNING for r in requests):
            self.running = [r for r in self.running if id(r) not in gone]
        if any(r.status is RequestStatus.WAITING for r in requests):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for request in requests:
            self.kv.free(request)
            request.status = RequestStatus.FINISHED
