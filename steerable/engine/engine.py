"""The engine (the driver): admit requests, schedule, hand the worker one plain step input per
step, and finish the previous step into outputs while the device runs the next.

It owns the scheduler, the KV block manager and the control planes of steering and capture; the
worker owns the model and everything on the device. Public methods are thread-safe: a step holds
the engine lock, and calls from other threads (a server's handlers) get in between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from typing import Any

from steerable.capture.planner import Delivery
from steerable.capture.session import CaptureSession
from steerable.config import EngineConfig
from steerable.engine.kv_cache import KVCacheManager
from steerable.engine.lock import EngineLock
from steerable.engine.output_processor import OutputProcessor, RequestGroup
from steerable.engine.scheduler import Scheduler
from steerable.engine.step_builder import StepBuilder
from steerable.engine.tokenizer import Tokenizer
from steerable.errors import EngineDeadError, EngineError, InvalidRequestError
from steerable.models.loader import load_hf_config, load_tokenizer, resolve_model
from steerable.models.registry import resolve_model_config
from steerable.outputs import RequestOutput
from steerable.request import PLACEHOLDER, Request, SchedulerOutput
from steerable.sampling_params import SamplingParams
from steerable.steering.manager import SteeringManager
from steerable.worker.model_runner import Launched, ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    sched: SchedulerOutput
    launched: Launched
    delivery: Delivery | None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.source = resolve_model(config.model)
        hf_config = load_hf_config(self.source)
        model_cls, self.model_config = resolve_model_config(hf_config)  # unknown ones fail before allocating
        self.layout = model_cls.hook_layout(self.model_config)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(hf_config, self.device)
        max_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                                 f"max_position_embeddings ({max_len})")
            max_len = config.max_model_len
        self.tokenizer = Tokenizer(load_tokenizer(self.source))
        self.worker = ModelRunner(config, self.model_config, self.source, self.device, self.dtype, max_len)
        if self.device.type == "cuda" and not config.enforce_eager:  # compile and capture now, not in the first steps
            self.worker.warmup()
        kv_capacity = self.worker.num_blocks * config.block_size
        if kv_capacity < max_len:
            logger.warning("max_model_len lowered from %d to the KV cache capacity of %d tokens", max_len, kv_capacity)
            max_len = kv_capacity
        self.max_model_len = max_len
        self.kv = KVCacheManager(self.worker.num_blocks, config.block_size, config.enable_prefix_caching)
        cfg = self.model_config
        self.steering = SteeringManager(cfg.hidden_size, cfg.num_layers, config.max_num_seqs)
        self.capture = CaptureSession(self.layout, self.dtype, pin_memory=self.device.type == "cuda")
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                   cache_limit=self.capture.cache_limit)
        self.builder = StepBuilder(config.max_num_seqs, self.worker.max_blocks_per_seq, config.block_size)
        self.outputs = OutputProcessor(self.tokenizer, max_len)
        self.requests: dict[str, Request] = {}  # by engine id
        self.groups: dict[str, RequestGroup] = {}  # by client id
        self._inflight: _InFlight | None = None  # launched, not finished
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.lock = EngineLock()
        self._closed = False

    # ---------------------------------------------------------------- public, thread-safe

    def add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    stream: bool = False) -> RequestGroup:
        """Validate and queue one prompt's ``params.n`` completions; ``stream`` reports every token.
        Raises ``InvalidRequestError`` (naming the field) and keeps nothing."""
        with self.lock.call():
            self._check_open()
            return self._add_request(client_id, prompt, params, stream)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort by client id (every completion) or engine id; everything held is freed now."""
        with self.lock.call():
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            outputs = []
            for rid in ids:
                group = self.groups.get(rid) or getattr(self.requests.get(rid), "group", None)
                if group is not None:
                    self._finish_group(group, "abort")
                    outputs.append(self.outputs.output(group))
            return outputs

    def step(self) -> list[RequestOutput]:
        """Run one engine step. A failure inside it finishes every request with
        ``finish_reason='error'``, frees what they held and raises ``EngineError``; the engine
        stays usable."""
        with self.lock.step():
            self._check_open()
            try:
                return self._step()
            except Exception as err:
                self._fail_all()
                raise EngineError(f"an engine step failed ({type(err).__name__}: {err}); every request in "
                                  "the engine was finished with finish_reason='error'") from err

    def finish_inflight(self) -> list[RequestOutput]:
        """Complete the step still on the device, if any, so no row of it is left to deliver later."""
        with self.lock.call():
            if self._inflight is None:
                return []
            inflight, self._inflight = self._inflight, None
            return self._complete(inflight)

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
            for group in list(self.groups.values()):
                self._finish_group(group, "abort")
            for consumer in self.capture.consumers:
                consumer.close()
            self.capture.consumers.clear()
            self.worker.shutdown()

    # ---------------------------------------------------------------- admission

    def _add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None,
                     stream: bool) -> RequestGroup:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if client_id in self.groups:
            raise InvalidRequestError(f"request_id: {client_id!r} is already running")
        prompt_text, token_ids = self._tokenize(prompt)
        children: list[Request] = []
        try:
            for index in range(params.n):
                children.append(self._admit(client_id, index, prompt_text, token_ids, _child_params(params, index)))
        except BaseException:
            for child in children:
                self.steering.release(child)
                self.capture.finish(child, aborted=True)
            raise
        group = RequestGroup(client_id, children, stream)
        self.groups[client_id] = group
        for child in children:
            child.group = group
            self.requests[child.request_id] = child
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

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt: token-id prompts must be lists of integers")
        if not ids:
            raise InvalidRequestError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt: {len(ids)} tokens do not fit max_model_len={self.max_model_len} "
                                      "(at least one token must be generated)")
        return text, ids

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
            inflight, self._inflight = self._inflight, None
            outputs += self._complete(inflight)
        launched = None
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            step = self.builder.build(self.num_steps, sched)
            step.steering = self.steering.plan(sched.scheduled, step.positions, step.token_ids, step.query_start)
            step.steering_update = self.steering.take_update()
            planned = self.capture.plan(sched.scheduled, step.positions, step.token_ids, step.query_start)
            delivery = None
            if planned is not None:
                step.capture, delivery = planned
            launched = _InFlight(sched, self.worker.launch(step), delivery)
            self._advance(sched)
            self.num_steps += 1
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        self._inflight = launched
        return outputs

    def _must_sync(self) -> bool:
        """Selections that read the token id of generated rows, and penalties that count generated
        tokens, need the last sampled token on the host before planning."""
        return (self.steering.reads_generated_tokens() or self.capture.reads_generated_tokens()
                or any(r.params.has_penalties for r in self.scheduler.running))

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

    def _complete(self, inflight: _InFlight) -> list[RequestOutput]:
        result = self.worker.finish(inflight.launched)
        if inflight.delivery is not None:
            self.capture.deliver(inflight.delivery, result.captured, result.graphed)
        outputs = []
        sampled = iter(zip(result.sampled, result.logprobs))
        for item in inflight.sched.scheduled:
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
            self.outputs.accept_token(request, token, token_logprobs)
            group = request.group
            if request.finish_reason is not None:
                self._finish(request)
                if group.finished:
                    outputs.append(self.outputs.output(group))
                    continue
            if group.stream:
                outputs.append(self.outputs.output(group))
        return outputs

    def _finish(self, request: Request, aborted: bool = False) -> None:
        if request.num_pending:  # tokens of steps still in flight will be discarded
            del request.all_token_ids[request.num_tokens - request.num_pending:]
            request.num_pending = 0
        self.scheduler.finish(request)
        self.builder.release(request.request_id)
        self.steering.release(request)
        request.captures, request.capture_meta = self.capture.finish(request, aborted)
        self.requests.pop(request.request_id, None)
        if request.group.finished:
            self.groups.pop(request.client_id, None)

    def _finish_group(self, group: RequestGroup, reason: str) -> None:
        for child in group.children:
            if not child.finished:
                child.finish_reason = reason
                self._finish(child, aborted=True)

    def _fail_all(self) -> None:
        """After a failed step: finish everything with 'error' so nothing stays half-updated."""
        self._inflight = None
        for group in list(self.groups.values()):
            self._finish_group(group, "error")

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
            "num_requests": len(self.requests),
            **self.worker.stats(),
        }


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` of ``n``: its own copy, seeded ``seed + index`` as vLLM seeds siblings."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)
