"""The engine (the driver): admit requests, schedule, hand the worker one plain step input per
step, and finish earlier steps into outputs while the device runs later ones.

It owns the scheduler, the KV block manager and the control planes of steering and capture; the
worker owns the model and everything on the device (one ``ModelRunner``, or the ranks of a
tensor/pipeline-parallel executor behind the same interface). Public methods are thread-safe: a
step holds the engine lock, and calls from other threads (a server's handlers) get in between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from steerable import cpu_memory, cpu_threads
from steerable.capture.activation_store import ActivationStore, empty_stats
from steerable.capture.planner import Delivery
from steerable.capture.prefix_rows import PrefixRows
from steerable.capture.session import CaptureSession
from steerable.config import EngineConfig
from steerable.executor.executor import create_worker
from steerable.distributed.placement import layer_partition, pipeline_micro_batches
from steerable.engine.kv_cache import KVCacheManager
from steerable.engine.lock import EngineLock
from steerable.engine import prompt_logprobs
from steerable.engine.output_processor import OutputProcessor, RequestGroup
from steerable.engine.admission import Admission, QueuedPrompts
from steerable.engine.control_planes import ControlPlanes
from steerable.engine.resumable import ResumableRequests
from steerable.engine.scheduler import Scheduler
from steerable.engine.shared_prefix import SharedPrefixDetector
from steerable.engine.step_builder import StepBuilder
from steerable.engine.tokenizer import Tokenizer
from steerable.errors import EngineDeadError, EngineError
from steerable.hook_points import ROUTER_LOGITS
from steerable.kv_groups import KVGroups
from steerable.models.loader import load_hf_config, load_tokenizer, resolve_model
from steerable.models.registry import resolve_model_config
from steerable.outputs import RequestOutput
from steerable.request import Request, SchedulerOutput
from steerable.sae.registry import SaeRegistry
from steerable.sampling_params import SamplingParams
from steerable.steering.manager import SteeringManager
from steerable.structured.plane import StructuredPlane
from steerable.step import PLACEHOLDER, PromptLogprobsInput, StepOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    sched: SchedulerOutput
    launched: Any  # the worker's handle
    delivery: Delivery | None
    prompt_logprobs: list[PromptLogprobsInput] | None = None


class LLMEngine(Admission, ResumableRequests, ControlPlanes):
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.source = resolve_model(config.model, config.revision, config.gguf_file)
        hf_config = load_hf_config(self.source)
        model_cls, self.model_config = resolve_model_config(hf_config)  # unknown ones fail before allocating
        self.layout = model_cls.hook_layout(self.model_config)
        self.device = config.resolve_device()
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        threads = 1
        if self.device.type == "cpu":  # every rank's threads together set what a step costs
            cpu_memory.keep_freed_memory()
            threads = (cpu_threads.apply(config.cpu_threads) if ranks == 1
                       else cpu_threads.choose(config.cpu_threads, ranks) * ranks)
        config.max_num_batched_tokens = config.resolve_step_tokens(self.device, self.model_config, threads)
        self.dtype = self.model_config.dtype = config.resolve_dtype(hf_config, self.device)
        max_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                                 f"max_position_embeddings ({max_len})")
            max_len = config.max_model_len
        self.tokenizer = Tokenizer(load_tokenizer(self.source))
        self.worker = create_worker(config, self.model_config, self.source, self.device, self.dtype, max_len)
        kv_groups = KVGroups.for_model(self.model_config)
        shared_prefix = self._shared_prefix(kv_groups)
        if ranks == 1 and (self.device.type == "cpu" or (self.device.type == "cuda" and not config.enforce_eager)):
            # compile, capture and pack weights now, not in the first steps
            self.worker.warmup(shared_prefix[0] if shared_prefix is not None else None)
        kv_capacity = kv_groups.max_tokens(self.worker.num_blocks, config.block_size, config.max_num_batched_tokens,
                                           max_len)
        if kv_capacity < max_len:
            logger.warning("max_model_len lowered from %d to the KV cache capacity of %d tokens", max_len, kv_capacity)
            max_len = kv_capacity
        self.max_model_len = self.model_config.max_model_len = max_len
        self.kv_capacity = self.worker.num_blocks * config.block_size  # tokens, every sequence's together
        self.kv = KVCacheManager(self.worker.num_blocks, config.block_size, config.enable_prefix_caching,
                                 kv_groups.windows)
        cfg = self.model_config
        stages = layer_partition(cfg.num_layers, config.pipeline_parallel_size)
        self.saes = SaeRegistry(cfg.hidden_size, cfg.num_layers, self.dtype, stages)
        router = self.layout.components.get(ROUTER_LOGITS)
        self.steering = SteeringManager(cfg.hidden_size, cfg.num_layers, config.max_num_seqs, self.saes,
                                        {layer: router.width for layer in router.layers} if router else None)
        self.activation_store = None
        prefix_rows = None
        if config.activation_store_bytes and not config.enable_prefix_caching:
            logger.warning("activation_store_bytes is ignored: the store serves prefix-cache hits, which are off")
        elif config.activation_store_bytes:
            self.activation_store = ActivationStore(config.activation_store_bytes, config.block_size)
            prefix_rows = PrefixRows(self.activation_store, self.dtype, self.kv.update_block_hashes)
        self.capture = CaptureSession(self.layout, self.dtype, pin_memory=self.device.type == "cuda",
                                      host_block_lifetime=self.worker.host_block_lifetime, pipeline_stages=stages,
                                      prefix_rows=prefix_rows)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                   cache_limit=self._cache_limit,
                                   micro_batches=pipeline_micro_batches(config.pipeline_parallel_size))
        self.builder = StepBuilder(config.max_num_seqs, self.worker.max_blocks_per_seq, config.block_size,
                                   kv_groups.num_groups, shared_prefix)
        self.outputs = OutputProcessor(self.tokenizer, max_len)
        self.structured = StructuredPlane(self.tokenizer.hf, cfg.vocab_size, cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}  # by engine id
        self.groups: dict[str, RequestGroup] = {}  # by client id
        self._paused: dict[str, Request] = {}  # streaming-input requests between chunks, by engine id
        self._prompt_logprobs: set[str] = set()  # engine ids whose prompt logprobs are not all recorded
        self._fanning_out: deque[RequestGroup] = deque()  # n-requests with completions still to create
        self._queued: deque[QueuedPrompts] = deque()  # prompts admitted as the scheduler takes them
        self.scheduler.refill = self._admit_queued
        # Launched, not finished, oldest first: one on a single stage (host work overlaps the
        # device), each micro-batch on a pipeline.
        self._inflight: deque[_InFlight] = deque()
        self._dead: str | None = None
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.lock = EngineLock()
        self._closed = False

    # ---------------------------------------------------------------- public, thread-safe

    def _cache_limit(self, request: Request, hit_tokens: int) -> int:
        """How many of the ``hit_tokens`` leading tokens the prefix cache holds a request may take:
        what steering allows, then what capture allows of that (its activation store may serve
        rows below the hit)."""
        return self.capture.cache_limit(request, min(hit_tokens, self.steering.cache_limit(request)))

    def _shared_prefix(self, kv_groups: KVGroups) -> tuple[int, SharedPrefixDetector] | None:
        """Where the step builder looks for shared prefixes: the first full-attention KV group (a
        sliding window may start inside a prefix), when the knob, the prefix cache (which makes
        the sharing) and a backend with the kernel (Triton) are all on."""
        config = self.config
        triton = config.attention_backend == "triton" or (config.attention_backend == "auto"
                                                          and self.device.type == "cuda")
        full = [g for g, window in enumerate(kv_groups.windows) if window is None]
        if not (config.enable_shared_prefix_attention and config.enable_prefix_caching and triton and full):
            return None
        return full[0], SharedPrefixDetector(config.block_size, config.shared_prefix_min_tokens,
                                             config.shared_prefix_min_requests)

    def add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    stream: bool = False, resumable: bool = False, increments: bool = False,
                    stop_at_layer: int | None = None) -> RequestGroup:
        """Validate and queue one prompt's ``params.n`` completions; ``stream`` reports every token.
        ``resumable`` (streaming input, n=1) pauses the request when a chunk's generation ends
        instead of finishing it: see ``extend_request`` and ``close_request_input``. ``increments``:
        each report is what is new since the last (``OutputProcessor.increment``), not a cumulative
        ``RequestOutput``, for a consumer across a process boundary. ``stop_at_layer=L`` (corpus
        capture, whose requests are only their prompt rows): the layers from L up never run for
        this request, which takes ``max_tokens=1`` and gets a placeholder token (see
        ``Admission._check_stop``). Raises ``InvalidRequestError`` (naming the field) and keeps nothing."""
        with self.lock.hold():
            self._check_open()
            return self._add_request(client_id, prompt, params, stream, resumable, increments, stop_at_layer)

    def queue_requests(self, requests: Sequence[tuple[str, str | Sequence[int], SamplingParams]],
                       stop_at_layer: int | None = None) -> QueuedPrompts:
        """Check ``(client_id, prompt, params)`` (each ``n`` = 1) now, raising the first bad one's
        ``InvalidRequestError`` with nothing queued, then queue them to be admitted as the scheduler
        has room (``QueuedPrompts``); the caller steps the engine and raises the batch's ``error``.
        ``stop_at_layer``: as ``add_request``'s, for every one of them."""
        with self.lock.hold():
            self._check_open()
            return self._queue_checked(requests, stop_at_layer)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids ``add_request`` would run for ``prompt`` (errors name ``prompt``)."""
        with self.lock.hold():
            return self._tokenize(prompt)[1]

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort by client id (every completion) or engine id; everything held is freed now."""
        with self.lock.hold():
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            self._drop_queued(set(ids))
            outputs = []
            for rid in ids:
                group = self.groups.get(rid) or getattr(self.requests.get(rid), "group", None)
                if group is not None:
                    self._finish_group(group, "abort")
                    outputs.append(self.outputs.report(group))
            return outputs

    def step(self) -> list[RequestOutput]:
        """Run one engine step. A failure inside it finishes every request with
        ``finish_reason='error'``, frees what they held and raises ``EngineError``; the engine
        stays usable."""
        with self.lock.hold():
            self._check_open()
            try:
                return self._step()
            except EngineDeadError as err:  # a worker rank is gone: nothing can run any more
                self._fail_all()
                self._dead = str(err)
                raise
            except Exception as err:
                self._fail_all()
                raise EngineError(f"an engine step failed ({type(err).__name__}: {err}); every request in "
                                  "the engine was finished with finish_reason='error'") from err

    def finish_inflight(self) -> list[RequestOutput]:
        """Complete the steps still on the device, so no row of them is left to deliver later."""
        with self.lock.hold():
            return self._finish_all()

    def _finish_all(self) -> list[RequestOutput]:
        outputs = []
        while self._inflight:
            outputs += self._emit(*self._collect(self._inflight.popleft()))
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Work a step can do (a paused streaming-input request waiting for its next chunk is none)."""
        return (self.scheduler.has_unfinished() or bool(self._inflight) or bool(self._fanning_out)
                or self._num_queued() > 0
                or any(r.chunks for r in self._paused.values()))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down; create a new LLM")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        """Abort what is running, close capture consumers, free the model and the KV cache.
        Idempotent; afterwards every call that needs the engine raises ``EngineDeadError``."""
        with self.lock.hold():
            if self._closed:
                return
            self._closed = True
            self._drain()
            for group in list(self.groups.values()):
                self._finish_group(group, "abort")
            for consumer in self.capture.consumers:
                consumer.close()
            self.capture.consumers.clear()
            try:
                self.capture.close()  # a threaded sink still running takes its last rows
            except Exception:  # its failure has no caller left to reach
                logger.warning("a capture sink failed while the engine shut down", exc_info=True)
            self.worker.shutdown()
            if self.device.type == "cpu":
                cpu_memory.release_freed_memory()  # the heap kept the model's and the cache's pages

    # ---------------------------------------------------------------- the loop

    def _step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one while the device runs it.

        The step launched here was scheduled before the previous step's tokens reached the host:
        each running request already holds a placeholder for its pending token, which the device
        fills in from the previous step's samples. Host bookkeeping (outputs, stop checks,
        detokenization, the next schedule) thus overlaps device work. A request that stops on a
        sampled token has one extra row computed and discarded. Returns finished requests and
        progress of streaming ones.
        """
        if self.scheduler.micro_batches > 1:
            return self._step_pipelined()
        outputs = []
        if self._inflight and self._must_sync():
            outputs += self._finish_all()
        if self._paused:
            outputs += self._resume_ready()
        launched = self._launch_next()
        if len(self._inflight) > 1 or (self._inflight and not launched):
            outputs += self._emit(*self._collect(self._inflight.popleft()))
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """A pipeline keeps M steps in flight, each its own micro-batch of requests, at least one per
        stage (``pipeline_micro_batches``); only the last stage samples, so a request waits for its
        token before it runs again. When all M are in flight the oldest's tokens are taken first,
        so its requests can join the step launched next; the rest of its processing
        (detokenization, stop checks, outputs) then overlaps the devices. As on one stage, a
        request that stops has one extra step computed and discarded."""
        ready, outputs = None, None
        if len(self._inflight) >= self.scheduler.micro_batches:
            ready = self._collect(self._inflight.popleft())
            if self.structured.live:  # a constrained request's next mask needs its token accepted first
                ready, outputs = None, self._emit(*ready)
        launched = self._launch_next()
        if outputs is not None:
            return outputs
        if ready is None and self._inflight and not launched:
            ready = self._collect(self._inflight.popleft())
        return self._emit(*ready) if ready is not None else []

    def _launch_next(self) -> bool:
        """Schedule and launch a step; False when there was nothing to run."""
        if self._fanning_out:
            self._fan_out()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            for request in sched.preempted:  # nothing runs, but its worker row must be rewritten on resume
                self.builder.release(request.request_id)
            return False
        step = self.builder.build(self.num_steps, sched)
        step.steering = self.steering.plan(sched.scheduled, step.positions, step.token_ids, step.query_start)
        step.steering_update = self.steering.take_update()
        step.sae_update = self.capture.features.take_update()
        planned = self.capture.plan(sched.scheduled, step.positions, step.token_ids, step.query_start)
        delivery = None
        if planned is not None:
            step.capture, delivery = planned
        if step.sampling is not None and self.structured.live:
            self.structured.plan(step.sampling, [s.request for s in sched.scheduled if s.samples])
        if self._prompt_logprobs:
            step.prompt_logprobs = prompt_logprobs.plan(sched.scheduled, step.query_start,
                                                        self._prompt_logprobs) or None
        self._inflight.append(_InFlight(sched, self.worker.launch(step), delivery, step.prompt_logprobs))
        self._advance(sched)
        self.num_steps += 1
        return True

    def _must_sync(self) -> bool:
        """Selections that read the token id of generated rows, and penalties that count generated
        tokens, need the last sampled token on the host before planning."""
        return (self.steering.reads_generated_tokens() or self.capture.reads_generated_tokens()
                or any(r.params.has_penalties for r in self.scheduler.running)
                or self.structured.must_sync(self.scheduler.running))

    @staticmethod
    def _advance(sched: SchedulerOutput) -> None:
        """What the launched step will have computed; sampling rows get a placeholder token."""
        for item in sched.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
            if item.samples:
                item.token_index = request.num_tokens
                request.all_token_ids.append(PLACEHOLDER)
                request.num_pending += 1

    def _collect(self, inflight: _InFlight) -> tuple[_InFlight, StepOutput]:
        """Wait for a step; deliver its captured rows and put its sampled tokens in place."""
        result = self.worker.finish(inflight.launched)
        if inflight.delivery is not None:
            self.capture.deliver(inflight.delivery, result.captured, result.graphed)
        for entry, reported in zip(inflight.prompt_logprobs or [], result.prompt_logprobs):
            request = inflight.sched.scheduled[entry.request].request
            if not request.finished and prompt_logprobs.record(request, entry, reported, self.tokenizer):
                self._prompt_logprobs.discard(request.request_id)
        sampled = iter(result.sampled)
        for item in inflight.sched.scheduled:
            request = item.request
            token = next(sampled) if item.samples else None
            if request.finished or request.paused:  # stopped (or aborted) while this step was in flight
                continue
            if token is not None:
                request.all_token_ids[item.token_index] = token
                request.num_pending -= 1
            self.kv.cache_computed_blocks(request)
        return inflight, result

    def _emit(self, inflight: _InFlight, result: StepOutput) -> list[RequestOutput]:
        """Stop checks, text and outputs for a collected step's tokens: one report per group, once
        all its completions have taken theirs."""
        reports: dict[str, RequestGroup] = {}
        sampled = iter(zip(result.sampled, result.logprobs))
        for item in inflight.sched.scheduled:
            if not item.samples:
                continue
            request = item.request
            token, token_logprobs = next(sampled)
            if request.finished or request.paused:  # stopped (or aborted) while this step was in flight
                continue
            self.outputs.accept_token(request, token, token_logprobs)
            self.structured.accept(request, token)
            group = request.group
            group.changed[request.index] = request
            if request.finish_reason is not None and request.more_input:  # a chunk ended: wait for the next
                self._pause(request)
                reports[group.client_id] = group
                continue
            if request.finish_reason is not None:
                self._finish(request)
            if group.stream or group.finished:
                reports[group.client_id] = group
        return [self.outputs.report(group) for group in reports.values()]

    def _finish(self, request: Request, aborted: bool = False, dequeued: bool = False) -> None:
        """``dequeued``: the scheduler has already let go of it (``Scheduler.finish_all``)."""
        request.drop_pending()  # tokens of steps still in flight will be discarded
        self._paused.pop(request.request_id, None)
        self._prompt_logprobs.discard(request.request_id)
        if not dequeued:
            self.scheduler.finish(request)
        self.builder.release(request.request_id)
        self.steering.release(request)
        self.structured.release(request)
        self.requests.pop(request.request_id, None)
        group = request.group
        group.child_finished(request)
        if group.finished:
            self.groups.pop(request.client_id, None)
        # Last: this hands captures to consumers, user code that may raise.
        request.captures, request.capture_meta = self.capture.finish(request, aborted)

    def _finish_group(self, group: RequestGroup, reason: str) -> None:
        """Every completion ends as ``reason``: those not yet created at once, the others leave the
        queues in one pass and free what they hold. Costs the completions created, not ``n``."""
        if group.num_uncreated:
            group.cancel_uncreated(reason)
            if group in self._fanning_out:
                self._fanning_out.remove(group)
            self._release_template(group)
            if group.finished:
                self.groups.pop(group.client_id, None)
        live = [child for child in group.children if not child.finished]
        self.scheduler.finish_all(live)
        for child in live:
            child.finish_reason = reason
            self._finish(child, aborted=True, dequeued=True)

    def _fail_all(self) -> None:
        """After a failed step: finish everything with 'error' so nothing stays half-updated."""
        self._drain()
        for group in list(self.groups.values()):
            self._finish_group(group, "error")

    def _drain(self) -> None:
        """Wait for the steps in flight and drop their results (every rank then agrees on what ran)."""
        while self._inflight:
            inflight = self._inflight.popleft()
            try:
                self.worker.finish(inflight.launched)
            except Exception:  # the step's own failure was raised already (or the worker is gone)
                logger.debug("dropping a failed in-flight step", exc_info=True)

    # ---------------------------------------------------------------- introspection

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy (what a server exports as metrics)."""
        with self.lock.hold():
            steering = self.steering.status()
            return {
                "num_steps": self.num_steps,
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_query_tokens": self.kv.query_tokens,
                "prefix_cache_hit_tokens": self.kv.hit_tokens,
                "num_free_blocks": self.kv.num_free_blocks,
                "num_blocks": self.kv.num_blocks,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting) + sum(g.num_uncreated for g in self._fanning_out),
                "num_paused": len(self._paused),
                "num_requests": len(self.requests),
                "steering_rows_in_use": steering["rows_in_use"],
                "steering_configs_in_use": steering["configs_in_use"],
                "capture_rows_total": self.capture.rows_delivered,
                "capture_requests_in_use": self.capture.requests_in_use,
                **(self.activation_store.stats() if self.activation_store is not None else empty_stats()),
                **self.worker.stats(),
            }

