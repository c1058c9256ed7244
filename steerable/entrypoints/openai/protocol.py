"""Request bodies as pydantic models (vLLM's field names). Unknown OpenAI fields are accepted and
ignored, as vLLM does; fields this server cannot honour are refused rather than ignored.
Structured-output fields (``structured_outputs``, ``guided_*``, ``response_format``) are read by
``structured.structured_from_body``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints

from steerable.entrypoints.openai.extensions import capture_from_json, module_ref_from_json, reject_unknown_extensions
from steerable.entrypoints.openai.structured import structured_from_body
from steerable.errors import InvalidRequestError
from steerable.sampling_params import SamplingParams, StructuredOutputsParams
from steerable.steering.wire import steering_from_json

MAX_LOGPROBS = 20  # as OpenAI and vLLM
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Bounds of the vector-toolkit routes: each pair or item is one prompt's forward pass (per scale,
# for a sweep), so these keep one request's work near that of a long completions batch.
MAX_TRAIN_PAIRS = 256
MAX_EVAL_ITEMS = 64
MAX_EVAL_SCALES = 11
MAX_TEXT_CHARS = 4000


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBase):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(OpenAIBase):
    """Fields completions and chat share: sampling, streaming, steering and capture."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # pydantic's wording, as vLLM's
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    steering_vectors: Any = None
    steering_module_ref: Any = None
    capture: Any = None
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)  # set by ``check``

    def check(self) -> None:
        """Refusals pydantic cannot express: ``steer*``/``capture*`` typos, unsupported fields."""
        reject_unknown_extensions(self.model_extra or {})
        self._structured = structured_from_body(self.model_extra or {})
        for name, value in self.unsupported().items():
            if value:
                raise InvalidRequestError(f"{name}: not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream=true")

    def unsupported(self) -> dict[str, Any]:
        return {name: (self.model_extra or {}).get(name) for name in ("functions",)}

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``prompt_logprobs``: what the request's form needs (completions ``echo`` with logprobs)
        when it asks for more than ``prompt_logprobs`` does."""
        if prompt_logprobs is None or (self.prompt_logprobs is not None and self.prompt_logprobs < 0):
            prompt_logprobs = self.prompt_logprobs  # a negative value is refused by SamplingParams, naming it
        elif self.prompt_logprobs is not None:
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs)
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p, top_k=0 if self.top_k == -1 else self.top_k, min_p=self.min_p, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            include_stop_str_in_output=self.include_stop_str_in_output, prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self._structured,
            steering_vectors=steering_from_json(self.steering_vectors),
            steering_module_ref=module_ref_from_json(self.steering_module_ref),
            capture=capture_from_json(self.capture))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM sends it only when ``include_usage`` is set too."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> dict[str, Any]:
        extra = self.model_extra or {}
        return {**super().unsupported(), "suffix": self.suffix, "best_of": self.best_of not in (None, self.n),
                "tools": extra.get("tools")}


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    include_reasoning: bool = True  # False: reasoning is split off and dropped (--reasoning-parser)

    def check(self) -> None:
        super().check()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message: needs add_generation_prompt=false")
        if self.continue_final_message and (not self.messages or self.messages[-1].get("role") != "assistant"):
            raise InvalidRequestError("continue_final_message: the last message must be the assistant's")

    def chat_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


class Strict(BaseModel):
    """Admin bodies: every key is known, or the request is refused naming it."""

    model_config = ConfigDict(extra="forbid")


class GlobalSteeringRequest(Strict):
    spec: Any
    replace: bool = True


class StreamStartRequest(Strict):
    layers: list[int] | None = None
    dtype: str | None = None
    reduce: str = "all"
    select: Any = None
    budget_rows: int | None = None
    hook: str = "post_mlp"
    saes: list[str] | None = None  # sae_features: the registered SAEs recorded
    top_k: int = 32


Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]


class TrainVectorRequest(Strict):
    """``POST /v1/vectors/train``: the arguments of ``steerable.vectors.train``; ``module`` also
    registers the vector as a steering module of that name."""

    positives: list[Text] = Field(min_length=1, max_length=MAX_TRAIN_PAIRS)
    negatives: list[Text] = Field(min_length=1, max_length=MAX_TRAIN_PAIRS)
    layers: list[int] | None = None
    method: str = "mean_diff"
    token: str = "last"
    hook: str = "post_mlp"
    normalize: bool | None = None
    module: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None


class EvaluateVectorRequest(Strict):
    """``POST /v1/vectors/evaluate``: ``steerable.vectors.evaluate`` of a registered module over
    two-choice items (the forms ``ABItem.parse`` reads) and scales."""

    module: str
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_EVAL_ITEMS)
    scales: list[float] = Field(default=[-2.0, -1.0, 0.0, 1.0, 2.0], min_length=1, max_length=MAX_EVAL_SCALES)
    positions: str = "all"
