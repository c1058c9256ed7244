"""The engine loop: admit requests, schedule, launch a step, finish the previous one into outputs."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from steerable.capture.serialization import CaptureMeta
from steerable.capture.session import ATTENTION_HEADS, HIDDEN_STATES, ROUTER_LOGITS, CaptureSession
from steerable.config import EngineConfig, ModelConfig
from steerable.engine.kv_cache import KVCacheManager
from steerable.engine.lock import EngineLock
from steerable.engine.request import PLACEHOLDER, Request, RequestGroup
from steerable.engine.scheduler import Scheduler, SchedulerOutput
from steerable.engine.tokenizer import Tokenizer
from steerable.errors import EngineDeadError, InvalidRequestError
from steerable.models.loader import load_hf_config, load_tokenizer, resolve_model
from steerable.models.registry import model_class
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.sampling_params import SamplingParams
from steerable.steering.manager import SteeringManager
from steerable.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.source = resolve_model(config.model)
        hf_config = load_hf_config(self.source)
        self.model_config = ModelConfig.from_hf(hf_config)
        model_class(self.model_config.architecture)  # unknown architectures fail before any allocation
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(hf_config, self.device)
        max_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                                 f"max_position_embeddings ({max_len})")
            max_len = config.max_model_len
        self.tokenizer = Tokenizer(load_tokenizer(self.source))
        self.runner = ModelRunner(config, self.model_config, self.source, self.device, self.dtype, max_len)
        kv_capacity = self.runner.num_blocks * config.block_size
        if kv_capacity < max_len:
            logger.warning("max_model_len lowered from %d to the KV cache capacity of %d tokens", max_len, kv_capacity)
            max_len = kv_capacity
        self.max_model_len = max_len
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        cfg = self.model_config
        self.steering = SteeringManager(cfg.hidden_size, cfg.num_layers, self.device, self.dtype,
                                        config.max_num_seqs)
        self.capture = self._capture_plane()
        self.runner.hooks.writers.append(self.steering)
        self.runner.hooks.readers.append(self.capture)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                   cache_limit=self.capture.cache_limit)
        self.requests: dict[str, Request] = {}  # by engine id
        self.groups: dict[str, RequestGroup] = {}  # by client id
        self._inflight: tuple | None = None  # (schedule, batch, sample handle) launched, not finished
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.lock = EngineLock()
        self._closed = False

    # ---------------------------------------------------------------- public, thread-safe

    def add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    stream: bool = False) -> RequestGroup:
        """Validate and queue one prompt's ``params.n`` completions; ``stream`` reports every token."""
        with self.lock.call():
            self._check_open()
            return self._add_request(client_id, prompt, params, stream)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort by client id (every completion) or engine id; everything held is freed now."""
        with self.lock.call():
            return self._abort_request(request_ids)

    def step(self) -> list[RequestOutput]:
        """Run one engine step (see ``_step``); control-plane calls from other threads go in between."""
        with self.lock.step():
            self._check_open()
            return self._step()

    def finish_inflight(self) -> list[RequestOutput]:
        """Complete the step still on the device, if any, so no row of it is left to deliver later."""
        with self.lock.call():
            if self._inflight is None:
                return []
            outputs = self._complete(*self._inflight)
            self._inflight = None
            return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down; create a new LLM")

    # ---------------------------------------------------------------- control planes

    def set_steering_vectors(self, spec: Any, replace: bool = True) -> None:
        with self.lock.call():
            self.steering.set_global(spec, replace)

    def clear_steering_vectors(self) -> None:
        with self.lock.call():
            self.steering.clear_global()

    def register_steering_modules(self, modules: dict[str, Any]) -> None:
        with self.lock.call():
            self.steering.register_modules(modules)

    def unregister_steering_modules(self, names: str | Sequence[str]) -> None:
        with self.lock.call():
            self.steering.unregister_modules(names)

    def list_steerable_layers(self) -> dict[str, list[int]]:
        return self.steering.steerable_layers()

    def get_steering_status(self) -> dict[str, Any]:
        with self.lock.call():
            return self.steering.status()

    def start_capture(self, stream: str, layers: Sequence[int] | None, dtype: str | None, reduce: str, select: Any,
                      budget_rows: int | None, hook: str) -> None:
        with self.lock.call():
            self.capture.start(stream, layers, dtype, reduce, select, budget_rows, hook)

    def stop_capture(self, stream: str) -> None:
        with self.lock.call():
            self.capture.stop(stream)

    def fetch_captured(self, stream: str, clear: bool, layers: Sequence[int] | None,
                       req_ids: Sequence[str] | None) -> tuple[dict, dict]:
        with self.lock.call():
            return self.capture.fetch(stream, clear, layers, req_ids)

    def clear_captured(self, stream: str) -> None:
        with self.lock.call():
            self.capture.clear(stream)

    def capture_status(self, stream: str) -> dict[str, Any]:
        with self.lock.call():
            return self.capture.status(stream)

    def add_capture_consumer(self, consumer: Any) -> None:
        with self.lock.call():
            self.capture.consumers.append(consumer)

    def remove_capture_consumer(self, consumer: Any) -> None:
        with self.lock.call():
            self.capture.consumers.remove(consumer)

    def shutdown(self) -> None:
        """Abort what is running, close capture consumers, free the model and the KV cache.
        Idempotent; afterwards every call that needs the engine raises ``EngineDeadError``."""
        with self.lock.call():
            if self._closed:
                return
            self._closed = True
            self._inflight = None
            self._abort_request(list(self.groups))
            for consumer in self.capture.consumers:
                consumer.close()
            self.capture.consumers.clear()
            self.runner.shutdown()

    # ---------------------------------------------------------------- admission

    def _add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    stream: bool = False) -> RequestGroup:
        """Validate and queue one prompt's ``params.n`` completions. Raises ``InvalidRequestError``
        (naming the field) and keeps nothing."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.logprob_token_ids or []):
            raise InvalidRequestError(f"logprob_token_ids: {params.logprob_token_ids} has ids outside the "
                                      f"vocabulary [0, {vocab})")
        if client_id in self.groups:
            raise InvalidRequestError(f"request_id: {client_id!r} is already running")
        prompt_text, token_ids = self._tokenize(prompt)
        children: list[Request] = []
        try:
            for index in range(params.n):
                children.append(self._admit(client_id, index, prompt_text, token_ids, _child_params(params, index)))
        except BaseException:
            for child in children:
                self._release_planes(child)
            raise
        group = RequestGroup(client_id, children, stream)
        self.groups[client_id] = group
        for child in children:
            child.group = group
            self.requests[child.request_id] = child
            self.runner.add_request(child)
            self.scheduler.add(child)
        return group

    def _admit(self, client_id: str, index: int, prompt_text: str | None, token_ids: list[int],
               params: SamplingParams) -> Request:
        request_id = f"{client_id}-{self._rng.getrandbits(32):08x}"
        eos = self.model_config.eos_token_ids
        request = Request(request_id, client_id, prompt_text, token_ids, params, self._rng.getrandbits(63), eos,
                          index)
        self.steering.admit(request)
        try:
            self.capture.admit(request)
        except BaseException:
            self.steering.release(request)
            raise
        request.detokenizer = self.tokenizer.stream(token_ids, params.skip_special_tokens)
        return request

    def _release_planes(self, request: Request) -> None:
        self.steering.release(request)
        self.capture.finish(request, aborted=True)

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt: token-id prompts must be lists of integers")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit max_model_len={self.max_model_len} "
                             "(at least one token must be generated)")
        return text, ids

    def _abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort by client id (every completion of it) or by engine id; frees everything held."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            group = self.groups.get(rid)
            if group is None and rid in self.requests:
                group = self.requests[rid].group
            if group is None:
                continue
            for child in group.children:
                if not child.finished:
                    child.finish_reason = "abort"
                    self._finish(child, aborted=True)
            outputs.append(self._output(group))
        return outputs

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
        outputs = []
        if self._inflight is not None and self._must_sync():
            outputs += self._complete(*self._inflight)
            self._inflight = None
        launched = None
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            batch = self.runner.prepare(sched)
            self.steering.prepare(batch)
            self.capture.prepare(batch)
            self.runner.bind_planes(batch)
            handle = self.runner.launch(batch)
            self.capture.copy_out(batch)
            self._advance(sched)
            self.num_steps += 1
            launched = (sched, batch, handle)
        if self._inflight is not None:
            outputs += self._complete(*self._inflight)
        self._inflight = launched
        return outputs

    def _must_sync(self) -> bool:
        """Selections that read the token id of generated rows need it on the host before planning."""
        return self.steering.reads_generated_tokens() or self.capture.reads_generated_tokens()

    def _advance(self, sched: SchedulerOutput) -> None:
        """What the launched step will have computed; sampling rows get a placeholder token."""
        for item in sched.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
            if item.samples:
                item.token_index = request.num_tokens
                request.all_token_ids.append(PLACEHOLDER)
                request.num_pending += 1

    def _complete(self, sched: SchedulerOutput, batch: Any, handle: Any) -> list[RequestOutput]:
        tokens, logprobs = self.runner.finish(handle)
        self.capture.deliver(batch)
        outputs = []
        sampled = iter(zip(tokens, logprobs))
        for item in sched.scheduled:
            request = item.request
            if not item.samples:
                if not request.finished:
                    self.kv.cache_computed_blocks(request)
                continue
            token, token_logprobs = next(sampled)
            if request.finished:  # stopped (or aborted) while this step was in flight
                continue
            request.all_token_ids[item.token_index] = token
            request.num_pending -= 1
            self.kv.cache_computed_blocks(request)
            self._accept_token(request, token, token_logprobs)
            group = request.group
            if request.finish_reason is not None:
                self._finish(request)
                if group.finished:
                    outputs.append(self._output(group))
                    continue
            if group.stream:
                outputs.append(self._output(group))
        return outputs

    def _accept_token(self, request: Request, token: int, token_logprobs: dict | None) -> None:
        piece = request.detokenizer.step(token)
        request.output_text += piece
        if token_logprobs is not None:
            request.logprobs.append({t: Logprob(lp, rank, self.tokenizer.token_text(t))
                                     for t, (lp, rank) in token_logprobs.items()})
            request.cumulative_logprob += token_logprobs[token][0]
        params = request.params
        if token in request.stop_token_ids:  # the sampler masks them until min_tokens
            request.finish_reason = "stop"
            request.stop_reason = None if token in request.eos_token_ids else token
            return
        if params.stop_strings and piece:
            if self._check_stop_strings(request, len(piece)):
                return
        known = request.num_tokens - request.num_pending
        if known - request.num_prompt_tokens >= params.max_tokens or known >= self.max_model_len:
            request.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(request: Request, new_chars: int) -> bool:
        text = request.output_text
        for stop in request.params.stop_strings:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1:
                request.output_text = text[:index]
                request.finish_reason = "stop"
                request.stop_reason = stop
                return True
        return False

    def _finish(self, request: Request, aborted: bool = False) -> None:
        if request.num_pending:  # tokens of steps still in flight will be discarded
            del request.all_token_ids[request.num_tokens - request.num_pending:]
            request.num_pending = 0
        self.scheduler.finish(request)
        self.runner.remove_request(request)
        self.steering.release(request)
        request.captures, request.capture_meta = self.capture.finish(request, aborted)
        self.requests.pop(request.request_id, None)
        if request.group.finished:
            self.groups.pop(request.client_id, None)

    def _output(self, group: RequestGroup) -> RequestOutput:
        """The group's cumulative state; captures (of every completion, by index) once all finished."""
        completions = [CompletionOutput(r.index, r.output_text, r.output_token_ids, r.finish_reason, r.logprobs,
                                        r.stop_reason, r.cumulative_logprob if r.logprobs is not None else None)
                       for r in group.children]
        first = group.children[0]
        finished = group.finished
        captures, capture_meta = _merge_captures(group.children) if finished else ({}, {})
        return RequestOutput(group.client_id, first.prompt, first.prompt_token_ids, completions, finished, captures,
                             capture_meta)

    def _capture_plane(self) -> CaptureSession:
        cfg = self.model_config
        model = self.runner.model
        all_layers = list(range(cfg.num_layers))
        router_layers = model.router_layers()
        heads_width = cfg.num_heads * cfg.head_dim
        layers = {HIDDEN_STATES: all_layers, ATTENTION_HEADS: all_layers, ROUTER_LOGITS: router_layers}
        widths = {HIDDEN_STATES: cfg.hidden_size, ATTENTION_HEADS: heads_width, ROUTER_LOGITS: cfg.num_experts}
        layouts = {
            HIDDEN_STATES: {layer: {"width": cfg.hidden_size} for layer in all_layers},
            ATTENTION_HEADS: {layer: {"num_heads": cfg.num_heads, "head_size": cfg.head_dim, "width": heads_width}
                              for layer in all_layers},
            ROUTER_LOGITS: {layer: {"num_experts": cfg.num_experts, "width": cfg.num_experts}
                            for layer in router_layers},
        }
        return CaptureSession(layers, widths, layouts, self.device, self.dtype)

    # ---------------------------------------------------------------- introspection

    def stats(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": self.kv.query_tokens,
            "prefix_cache_hit_tokens": self.kv.hit_tokens,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.kv.num_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of ``n``: its own copy, seeded ``seed + index`` as vLLM seeds siblings."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


def _merge_captures(children: list[Request]) -> tuple[dict, dict]:
    """One request's captures as they are; several completions' rows concatenated by index, each
    row still labelled with its own engine request id."""
    if len(children) == 1:
        return children[0].captures, children[0].capture_meta
    tensors: dict[str, dict[int, Any]] = {}
    metas: dict[str, dict[int, Any]] = {}
    for stream in children[0].captures:
        tensors[stream], metas[stream] = {}, {}
        for layer in children[0].captures[stream]:
            tensors[stream][layer] = torch.cat([c.captures[stream][layer] for c in children])
            metas[stream][layer] = CaptureMeta.concat([c.capture_meta[stream][layer] for c in children])
    return tensors, metas
