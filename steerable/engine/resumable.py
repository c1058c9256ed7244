"""Streaming input (vLLM's resumable requests), the part of the engine loop that lets a request
grow: when a chunk's generation ends the request pauses, keeping its KV blocks, its steering rows
and its capture state; the next chunk extends its prompt and it runs on. Rows already delivered
to capture stay delivered (the high-water mark survives the growth), so none arrives twice."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from steerable.errors import InvalidRequestError
from steerable.outputs import RequestOutput
from steerable.request import Request
from steerable.sampling_params import SamplingParams
from steerable.structured.plane import refuse_streaming_input


class ResumableRequests:
    """Mixed into ``LLMEngine``: the public calls that feed a resumable request and the pause /
    resume steps the loop runs for it."""

    def extend_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> None:
        """Queue the next input chunk of a resumable request; it applies once the current chunk's
        generation has ended (vLLM's streaming input). The new prompt is the previous one, the
        tokens generated for it except the last (which has no KV), then ``prompt`` (text is
        tokenized without special tokens). ``params`` (default: the previous chunk's) may change
        sampling; the request keeps its steering, capture and cache salt."""
        with self.lock.hold():
            self._check_open()
            request = self._open_session(client_id)
            params = self._chunk_params(request, params)
            request.chunks.append((self._tokenize(prompt, continuation=True)[1], params))

    def close_request_input(self, client_id: str) -> list[RequestOutput]:
        """No more chunks: the request finishes when its queued ones are done, at once if it is
        paused with none left (its final output is returned then)."""
        with self.lock.hold():
            self._check_open()
            request = self._open_session(client_id)
            request.input_closed = True
            if request.paused and not request.chunks:
                self._finish(request)
                return [self.outputs.report(request.group)]
            return []

    def _pause(self, request: Request) -> None:
        """A chunk's generation has ended: keep blocks and planes, wait for the next chunk."""
        request.drop_pending()
        self.scheduler.pause(request)
        self.builder.release(request.request_id)  # a fresh worker slot, all blocks rewritten, on resume
        self._paused[request.request_id] = request

    def _resume_ready(self) -> list[RequestOutput]:
        """Apply the next chunk of each paused request that no step in flight still computes for
        (that step's rows for it are dropped, and must not meet the new chunk's rows)."""
        busy = {id(item.request) for inflight in self._inflight for item in inflight.sched.scheduled}
        outputs = []
        for request in list(self._paused.values()):
            if not request.chunks or id(request) in busy:
                continue
            if len(self.scheduler.running) >= self.config.max_num_seqs:
                break
            chunk, params = request.chunks.popleft()
            if request.num_tokens - 1 + len(chunk) >= self.max_model_len:
                request.finish_reason, request.stop_reason = "length", None  # the session no longer fits
                self._finish(request)
                outputs.append(self.outputs.report(request.group))
                continue
            del self._paused[request.request_id]
            keep = request.grow(chunk, params)
            self.kv.truncate_hashes(request, keep)
            request.detokenizer = self.tokenizer.stream(request.prompt_token_ids, params.skip_special_tokens)
            self.capture.prompt_extended(request)
            self.steering.prompt_extended(request)
            self.scheduler.resume(request)
        return outputs

    def _open_session(self, client_id: str) -> Request:
        group = self.groups.get(client_id)
        if group is None or not group.children[0].resumable:
            raise InvalidRequestError(f"request_id: {client_id!r} is not a running streaming-input request")
        request = group.children[0]
        if request.input_closed:
            raise InvalidRequestError(f"request_id: the input of {client_id!r} is already closed")
        return request

    @staticmethod
    def _chunk_params(request: Request, params: SamplingParams | None) -> SamplingParams:
        """A chunk's sampling; what the request was admitted with (steering, capture, salt) stays."""
        if params is None:
            return request.params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        kept = ("steering_vectors", "steering_module_ref", "capture", "cache_salt")
        for name in kept:
            value = getattr(params, name)
            if value is not None and value is not getattr(request.params, name):
                raise InvalidRequestError(f"{name}: a streaming-input chunk keeps its request's steering, capture and "
                                          "cache salt; leave it unset")
        if params.n != 1:
            raise InvalidRequestError(f"n: streaming input takes one completion, got n={params.n}")
        refuse_streaming_input(params)
        return dataclasses.replace(params, **{name: getattr(request.params, name) for name in kept})

