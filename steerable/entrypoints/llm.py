"""``LLM``: the offline Python entry point (vLLM-compatible names)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from steerable.config import EngineConfig
from steerable.engine.engine import LLMEngine
from steerable.models.loader import DEFAULT_MODEL
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model once, then generate, chat, steer and capture."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, kv_cache_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, **kwargs: Any):
        config = EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                              block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=enable_prefix_caching,
                              enforce_eager=enforce_eager, seed=seed, tensor_parallel_size=tensor_parallel_size,
                              pipeline_parallel_size=pipeline_parallel_size, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    # ------------------------------------------------------------ steering control plane

    def set_steering_vectors(self, spec: Any, replace: bool = True) -> None:
        """Global steering for every request admitted from now on (running ones keep theirs)."""
        self.engine.steering.set_global(spec, replace)

    def clear_steering_vectors(self) -> None:
        self.engine.steering.clear_global()

    def register_steering_modules(self, modules: dict[str, Any]) -> None:
        """Named specs that requests reference with ``SamplingParams(steering_module_ref=name | (name, scale))``."""
        self.engine.steering.register_modules(modules)

    def unregister_steering_modules(self, names: str | Sequence[str]) -> None:
        self.engine.steering.unregister_modules(names)

    def list_steerable_layers(self) -> dict[str, list[int]]:
        return self.engine.steering.steerable_layers()

    def get_steering_status(self) -> dict[str, Any]:
        return self.engine.steering.status()

    # ------------------------------------------------------------ capture streams

    def start_capture(self, stream: str = "hidden_states", layers: Sequence[int] | None = None,
                      dtype: str | None = None, reduce: str = "all", select: Any = None,
                      budget_rows: int | None = None, hook: str = "post_mlp") -> None:
        """Record ``stream`` for every request from now on until ``stop_capture``."""
        self.engine.capture.start(stream, layers, dtype, reduce, select, budget_rows, hook)

    def stop_capture(self, stream: str = "hidden_states") -> None:
        self.engine.capture.stop(stream)

    def fetch_captured(self, stream: str = "hidden_states", clear: bool = True, layers: Sequence[int] | None = None,
                       req_ids: Sequence[str] | None = None) -> tuple[dict, dict]:
        """(tensors, meta) per layer; ``req_ids`` (client ids) drains request by request."""
        return self.engine.capture.fetch(stream, clear, layers, req_ids)

    def clear_captured(self, stream: str = "hidden_states") -> None:
        self.engine.capture.clear(stream)

    def capture_status(self, stream: str = "hidden_states") -> dict[str, Any]:
        return self.engine.capture.status(stream)

    def add_capture_consumer(self, consumer: Any) -> None:
        """Every finished request's own captures (``SamplingParams(capture=...)``) also go to ``consumer``."""
        self.engine.capture.consumers.append(consumer)

    def remove_capture_consumer(self, consumer: Any) -> None:
        self.engine.capture.consumers.remove(consumer)

    # ------------------------------------------------------------ generation

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        return self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        added = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(engine.add_request(str(next(self._ids)), prompt, p))
        except Exception:
            engine.abort_request([r.request_id for r in added])
            raise
        order = {r.client_id: i for i, r in enumerate(added)}
        results: list[RequestOutput | None] = [None] * len(added)
        pending = {r.request_id for r in added}
        bar = tqdm(total=len(added), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while pending:
                for out in engine.step():
                    if out.finished:
                        index = order[out.request_id]
                        results[index] = out
                        pending.discard(added[index].request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return results


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("prompts: at least one prompt is required")
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return params

