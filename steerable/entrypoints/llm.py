"""``LLM``: the offline Python entry point (vLLM-compatible names)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from steerable.config import EngineConfig, ModelConfig
from steerable.engine.admission import QueuedPrompts
from steerable.engine.engine import LLMEngine
from steerable.errors import InvalidRequestError
from steerable.inputs import Prompt, as_prompt_list
from steerable.models.loader import DEFAULT_MODEL
from steerable.outputs import RequestOutput
from steerable.sae.model import SAE
from steerable.sae.transcoder import Transcoder
from steerable.sampling_params import SamplingParams
from steerable.steering.spec import SteeringSpec

class LLM:
    """Load a model once, then generate, chat, steer and capture."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, kv_cache_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, revision: str | None = None,
                 gguf_file: str | None = None, **kwargs: Any):
        """``model``: a demo name, a local HF directory or .gguf file, or a hub id ``org/name`` (at
        ``revision``; ``gguf_file`` picks one file of a GGUF repository), see docs/models.md."""
        config = EngineConfig(model=model, revision=revision, gguf_file=gguf_file, dtype=dtype, device=device,
                              max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                              block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=enable_prefix_caching,
                              enforce_eager=enforce_eager, seed=seed, tensor_parallel_size=tensor_parallel_size,
                              pipeline_parallel_size=pipeline_parallel_size, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under the name vLLM gives it."""
        return self.engine

    @property
    def model_config(self) -> ModelConfig:
        """The model's shape (``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
        ``head_dim``, ``vocab_size``, ``hf_config``) and what the engine chose (``dtype``,
        ``max_model_len``); also ``llm.llm_engine.model_config``, as vLLM users reach it."""
        return self.engine.model_config

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    def shutdown(self) -> None:
        """Close capture consumers and free device memory (idempotent); the LLM is unusable after."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ steering control plane

    def set_steering_vectors(self, spec: Any, replace: bool = True) -> None:
        """Global steering for every request admitted from now on (running ones keep theirs)."""
        self.engine.set_steering_vectors(spec, replace)

    def clear_steering_vectors(self) -> None:
        self.engine.clear_steering_vectors()

    def register_steering_modules(self, modules: dict[str, Any]) -> None:
        """Named specs that requests reference with ``SamplingParams(steering_module_ref=name | (name, scale))``."""
        self.engine.register_steering_modules(modules)

    def unregister_steering_modules(self, names: str | Sequence[str]) -> None:
        self.engine.unregister_steering_modules(names)

    def get_steering_module(self, name: str) -> SteeringSpec:
        """What module ``name`` adds and clamps: its interventions as registered (scales folded in)."""
        return self.engine.get_steering_module(name)

    def list_steerable_layers(self) -> dict[str, list[int]]:
        return self.engine.list_steerable_layers()

    def get_steering_status(self) -> dict[str, Any]:
        return self.engine.get_steering_status()

    # ------------------------------------------------------------ capture streams

    # ------------------------------------------------------------ SAEs

    def register_sae(self, name: str, sae: SAE | Transcoder) -> None:
        """Name an SAE or a transcoder (``SAE.load``, ``Transcoder.load`` or in memory) for feature
        steering and capture; its ``d_in`` must be the hidden size and its layers the model's."""
        self.engine.register_sae(name, sae)

    def list_saes(self) -> dict[str, dict[str, Any]]:
        """``{name: {"layer", "hook", "d_sae", "architecture"}}``; a transcoder adds ``kind``,
        ``layers``, ``hook_out``, ``d_transcoder`` and ``skip``."""
        return self.engine.list_saes()

    def get_sae(self, name: str, known_hash: bytes | None = None) -> SAE | None:
        """The SAE registered as ``name`` (the engine's copy: on the CPU, in the model dtype); None
        when ``known_hash`` is its ``content_hash``, so a caller that keeps a copy (a server process
        beside the engine's) is not sent the weights again while they are current."""
        sae = self.engine.get_sae(name)
        return None if known_hash is not None and known_hash == sae.content_hash else sae

    def unregister_sae(self, name: str) -> None:
        """Refused (``ValueError`` naming it) while global steering, a module or a live request uses it."""
        self.engine.unregister_sae(name)

    def start_capture(self, stream: str = "hidden_states", layers: Sequence[int] | None = None,
                      dtype: str | None = None, reduce: str = "all", select: Any = None,
                      budget_rows: int | None = None, hook: str = "post_mlp", saes: Sequence[str] | None = None,
                      top_k: int = 32) -> None:
        """Record ``stream`` for every request from now on until ``stop_capture``; ``sae_features``
        records the ``top_k`` highest features of each registered SAE named in ``saes``."""
        self.engine.start_capture(stream, layers, dtype, reduce, select, budget_rows, hook, saes=saes, top_k=top_k)

    def stop_capture(self, stream: str = "hidden_states") -> None:
        self.engine.stop_capture(stream)

    def fetch_captured(self, stream: str = "hidden_states", clear: bool = True, layers: Sequence[int] | None = None,
                       req_ids: Sequence[str] | None = None) -> tuple[dict, dict]:
        """(tensors, meta) per layer; ``req_ids`` (client ids) drains request by request."""
        return self.engine.fetch_captured(stream, clear, layers, req_ids)

    def clear_captured(self, stream: str = "hidden_states") -> None:
        self.engine.clear_captured(stream)

    def capture_status(self, stream: str = "hidden_states") -> dict[str, Any]:
        return self.engine.capture_status(stream)

    def add_capture_consumer(self, consumer: Any) -> None:
        """Every finished request's own captures (``SamplingParams(capture=...)``) also go to ``consumer``."""
        self.engine.add_capture_consumer(consumer)

    def remove_capture_consumer(self, consumer: Any) -> None:
        self.engine.remove_capture_consumer(consumer)

    # ------------------------------------------------------------ generation

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        prompt_list = as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams
             | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        outputs = self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm)
        for out in outputs:  # as vLLM: the templated conversation the model saw
            out.prompt = tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        return outputs

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        """Prompts of one completion each are checked up front (a bad one refuses the call before
        any prompt runs) and admitted as the scheduler takes them, so building their state
        (steering configs, capture, grammars) overlaps the device's work on the first ones. With
        ``n`` > 1 they are admitted up front: a group's siblings are created as soon as the batch
        has room, which for a group admitted up front can be before its first completion runs, so
        queuing it would change the steps."""
        engine = self.llm_engine
        if all(isinstance(p, SamplingParams) and p.n == 1 for p in params):
            ids = [str(next(self._ids)) for _ in prompts]
            return run_to_completion(engine, ids, use_tqdm, engine.queue_requests(list(zip(ids, prompts, params))))
        added = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(engine.add_request(str(next(self._ids)), prompt, p))
        except BaseException:
            engine.abort_request([g.client_id for g in added])
            raise
        return run_to_completion(engine, [g.client_id for g in added], use_tqdm)


def run_to_completion(engine: LLMEngine, client_ids: list[str], use_tqdm: bool = False,
                      queued: QueuedPrompts | None = None) -> list[RequestOutput]:
    """Step ``engine`` until the requests ``client_ids`` have finished; their final outputs in that
    order. On any error (or an interrupt) the unfinished ones are aborted, freeing what they hold;
    ``queued``: their prompts are queued, and one that fails admission raises its error."""
    order = {client_id: i for i, client_id in enumerate(client_ids)}
    results: list[RequestOutput | None] = [None] * len(client_ids)
    pending = set(order)
    bar = tqdm(total=len(client_ids), desc="Generating", disable=not use_tqdm, unit="req")
    try:
        while pending:
            outputs = engine.step()
            if queued is not None and queued.error is not None:
                raise queued.error
            for out in outputs:
                if out.finished and out.request_id in pending:
                    results[order[out.request_id]] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        engine.finish_inflight()  # its rows belong to finished requests: delivered nowhere
    except BaseException as err:
        engine.abort_request(list(pending))
        if queued is not None and err is queued.error:  # a bad prompt: the engine is fine, leave nothing in flight
            engine.finish_inflight()
        raise
    finally:
        bar.close()
    return results


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"sampling_params: got {len(params)} for {n} prompts")
    return params
