"""Request bodies of the Neuronpedia inference API (client ``neuronpedia-inference-client`` 1.10.1,
API 1.9.0): the same field names, types, required fields and bounds as the client's models, so a
body the client builds parses here and anything else is refused naming the field (422, as the
reference server's FastAPI answers a body that fails its schema)."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt
Vector = list[Number]


class SteerMethod(str, enum.Enum):
    SIMPLE_ADDITIVE = "SIMPLE_ADDITIVE"
    ORTHOGONAL_DECOMP = "ORTHOGONAL_DECOMP"
    PROJECTION_CAP = "PROJECTION_CAP"


class SteerType(str, enum.Enum):
    STEERED = "STEERED"
    DEFAULT = "DEFAULT"


class SteerFeature(BaseModel):
    """One SAE feature: ``source`` is a registered SAE; ``steering_vector``, when given, is steered
    with instead of the feature's decoder row."""

    model: StrictStr
    source: StrictStr
    index: StrictInt
    strength: Number
    steering_vector: Vector | None = None


class SteerVector(BaseModel):
    """A raw vector at a TransformerLens hook (``blocks.L.hook_resid_pre|mid|post``)."""

    steering_vector: Vector
    strength: Number
    hook: StrictStr


class ChatMessage(BaseModel):
    content: StrictStr
    role: StrictStr


class SteerRequest(BaseModel):
    model: StrictStr
    steer_method: SteerMethod
    normalize_steering: StrictBool
    types: Annotated[list[SteerType], Field(min_length=1)]
    features: list[SteerFeature] | None = None
    vectors: list[SteerVector] | None = None
    n_completion_tokens: Annotated[int, Field(strict=True, ge=1)]
    temperature: Annotated[float, Field(strict=True, ge=0)] | Annotated[int, Field(strict=True, ge=0)]
    strength_multiplier: Number
    freq_penalty: Number
    seed: Number
    stream: StrictBool | None = False
    n_logprobs: Annotated[int, Field(strict=True, ge=0, le=10)] | None = 0


class SteerCompletionRequest(SteerRequest):
    prompt: StrictStr


class SteerCompletionChatRequest(SteerRequest):
    prompt: list[ChatMessage]
    is_assistant_axis: StrictBool | None = False
    steer_special_tokens: StrictBool


class TopkByTokenFields(BaseModel):
    model: StrictStr
    source: StrictStr
    top_k: StrictInt | None = None
    ignore_bos: StrictBool


class ActivationTopkByTokenRequest(TopkByTokenFields):
    prompt: StrictStr


class ActivationTopkByTokenBatchRequest(TopkByTokenFields):
    prompts: list[StrictStr]


class AllFields(BaseModel):
    """``selected_sources`` empty: every SAE of the source set."""

    model: StrictStr
    source_set: StrictStr
    selected_sources: list[StrictStr]
    sort_by_token_indexes: list[StrictInt]
    ignore_bos: StrictBool
    num_results: StrictInt | None = 25


class ActivationAllRequest(AllFields):
    prompt: StrictStr


class ActivationAllBatchRequest(AllFields):
    prompts: list[StrictStr]


class SingleFields(BaseModel):
    """A feature (``source`` + ``index``, the index as a string) or a vector at a hook: one of the two."""

    model: StrictStr
    source: StrictStr | None = None
    index: StrictStr | None = None
    vector: Vector | None = None
    hook: StrictStr | None = None


class ActivationSingleRequest(SingleFields):
    prompt: StrictStr


class ActivationSingleBatchRequest(SingleFields):
    prompts: list[StrictStr]


class ActivationSourceRequest(BaseModel):
    prompts: list[StrictStr]
    model: StrictStr
    source: StrictStr


class TokenizeRequest(BaseModel):
    model: StrictStr
    text: StrictStr
    prepend_bos: StrictBool | None = None


class FeatureRef(BaseModel):
    model: StrictStr
    source: StrictStr
    index: StrictInt


class SaeVectorRequest(BaseModel):
    model: StrictStr
    source: StrictStr
    index: StrictInt


class DecoderCossimRequest(BaseModel):
    feature: FeatureRef | None = None
    vector: Vector | None = None
    model: StrictStr
    source: StrictStr
    num_results: StrictInt
