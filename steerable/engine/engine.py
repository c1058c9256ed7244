"""The engine loop: admit requests, schedule, launch a step, finish the previous one into outputs."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from steerable.capture.session import ATTENTION_HEADS, HIDDEN_STATES, ROUTER_LOGITS, CaptureSession
from steerable.config import EngineConfig, ModelConfig
from steerable.engine.kv_cache import KVCacheManager
from steerable.engine.request import PLACEHOLDER, Request, RequestStatus
from steerable.engine.scheduler import Scheduler, SchedulerOutput
from steerable.engine.tokenizer import Tokenizer
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
        self.requests: dict[str, Request] = {}
        self._streaming: set[str] = set()
        self._inflight: tuple | None = None  # (schedule, batch, sample handle) launched, not finished
        self._rng = random.Random(config.seed)
        self.num_steps = 0

    # ---------------------------------------------------------------- admission

    def add_request(self, client_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    stream: bool = False) -> Request:
        """Validate and queue one request. Raises ValueError (naming the field) and keeps nothing."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt_text, token_ids = self._tokenize(prompt)
        request_id = f"{client_id}-{self._rng.getrandbits(32):08x}"
        eos = self.model_config.eos_token_ids
        request = Request(request_id, client_id, prompt_text, token_ids, params, self._rng.getrandbits(63), eos)
        self.steering.admit(request)
        try:
            self.capture.admit(request)
        except ValueError:
            self.steering.release(request)
            raise
        request.detokenizer = self.tokenizer.stream(token_ids, params.skip_special_tokens)
        self.requests[request_id] = request
        if stream:
            self._streaming.add(request_id)
        self.runner.add_request(request)
        self.scheduler.add(request)
        return request

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

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort by engine or client id; frees everything the request held."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            for request in [r for r in self.requests.values() if rid in (r.request_id, r.client_id)]:
                request.finish_reason = "abort"
                self._finish(request, aborted=True)
                outputs.append(self._output(request))
        return outputs

    # ---------------------------------------------------------------- the loop

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
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
            if request.finish_reason is not None:
                self._finish(request)
                outputs.append(self._output(request))
            elif request.request_id in self._streaming:
                outputs.append(self._output(request))
        return outputs

    def _accept_token(self, request: Request, token: int, token_logprobs: dict | None) -> None:
        piece = request.detokenizer.step(token)
        request.output_text += piece
        if token_logprobs is not None:
            request.logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t], False))
                                     for t, (lp, rank) in token_logprobs.items()})
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
        self._streaming.discard(request.request_id)

    def _output(self, request: Request) -> RequestOutput:
        completion = CompletionOutput(0, request.output_text, request.output_token_ids, request.finish_reason,
                                      request.logprobs, request.stop_reason)
        finished = request.status is RequestStatus.FINISHED
        return RequestOutput(request.client_id, request.prompt, request.prompt_token_ids, [completion], finished,
                             request.captures if finished else {}, request.capture_meta if finished else {})

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
