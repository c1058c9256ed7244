"""Per-request generation settings, validated where the request enters the engine: ``SamplingParams``
and what a request asks its output to match, ``StructuredOutputsParams`` (vLLM keeps both in its
``sampling_params`` module too). Only the description of a constraint lives here, checked for shape;
the grammar library compiles it when the request is admitted (``steerable.structured.backend``),
where a bad schema, regex or grammar is refused naming the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from steerable.checks import is_int, is_number
from steerable.errors import InvalidRequestError

# The constraint kinds of structured outputs: exactly one is set.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """``json``: a JSON schema (dict or its JSON text); ``regex``: the output fullmatches it;
    ``choice``: the output is one of these strings; ``grammar``: an EBNF (GBNF) grammar whose
    start rule is ``root``; ``json_object=True``: any JSON object. ``disable_any_whitespace``
    keeps JSON compact (no free whitespace between tokens). ``disable_additional_properties`` is
    accepted as vLLM accepts it: the grammar library's strict mode already forbids properties a
    schema does not name. ``whitespace_pattern`` and ``structural_tag`` are refused by name."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The request field the constraint came from, for error messages (a server sets it to
    # ``guided_regex``, ``response_format``, ...): travels with the params, not a constructor argument.
    _field: str = field(default="structured_outputs", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set (``validate`` makes it exactly one)."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """What an error about the constraint names: ``structured_outputs.<kind>``, or the field it came from."""
        return f"{self._field}.{self.kind}" if self._field == "structured_outputs" else self._field

    def validate(self, field: str = "structured_outputs") -> None:
        """``ValueError`` naming ``field.<name>`` for a constraint of the wrong shape."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{field}.{name}: not supported (the xgrammar backend has no "
                                          f"{name.replace('_', ' ')})")
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(f"{field}: set exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                                      f"{', '.join(set_) if set_ else 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as err:
                raise InvalidRequestError(f"{field}.json: not valid JSON ({err})") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(f"{field}.json: must be a JSON schema (dict or JSON text), got "
                                      f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"{field}.{name}: must be a non-empty string, got {value!r}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{field}.choice: must be a non-empty list of non-empty strings, "
                                      f"got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise InvalidRequestError(f"{field}.json_object: must be a bool, got {self.json_object!r}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{field}.{name}: must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def coerce(cls, value: Any, field: str = "structured_outputs") -> StructuredOutputsParams:
        """A ``StructuredOutputsParams`` from itself or its dict form (unknown keys named)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field}: must be a StructuredOutputsParams or a dict of its fields, got "
                                      f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{field}: unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**value)
        except InvalidRequestError as err:
            raise InvalidRequestError(str(err).replace("structured_outputs", field, 1)) from None

    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (siblings and repeats share one compilation)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        elif isinstance(spec, list):
            spec = tuple(spec)
        return self.kind, spec, self.disable_any_whitespace


# vLLM's older name for the same description.
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to generate for one request (vLLM names and defaults; ``temperature=0`` is greedy).

    ``logprobs=N`` returns the sampled token and the N most likely ones at every sampled position,
    ``-1`` every vocabulary entry (full next-token distributions, e.g. for a KL); the ids in
    ``logprob_token_ids`` are always added (SGLang's ``token_ids_logprob``), which implies
    ``logprobs=0`` when ``logprobs`` is None.

    ``prompt_logprobs=k`` reports, for every prompt token after the first, its logprob and rank
    and the k most likely tokens at that position (``RequestOutput.prompt_logprobs``; such a
    request does not read the prefix cache, whose blocks carry no logits). ``logit_bias`` adds
    a bias in [-100, 100] to token ids before sampling and ``allowed_token_ids`` keeps only those
    ids (neither changes the reported logprobs, which are the model's own, as vLLM's default).
    ``truncate_prompt_tokens=k`` keeps the last k prompt tokens (-1: as many as ``max_model_len``
    allows). ``structured_outputs`` (a ``StructuredOutputsParams`` or its dict; ``guided_decoding``
    is vLLM's older name for it) constrains the output to a JSON schema, regex, choice or grammar;
    constrained rows report the logprobs of the masked logits, as vLLM does. Fields vLLM has and
    steerable does not implement (``bad_words``, ``best_of`` other than ``n``,
    ``spaces_between_special_tokens=False``) raise ``ValueError`` naming them.

    ``steering_vectors``, ``steering_module_ref`` and ``capture`` attach the steering and capture
    planes to this request; they are validated against the model when the request is admitted.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    steering_vectors: Any = None
    steering_module_ref: str | tuple[str, float] | None = None
    capture: Any = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    best_of: int | None = None
    bad_words: list[str] | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # (bias ids, biases, allowed ids) as arrays for the sampler, None when the row needs neither.
    row_bias: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprob_token_ids is not None:
            if not isinstance(self.logprob_token_ids, (list, tuple)):
                raise InvalidRequestError(f"logprob_token_ids must be a list of token ids, got "
                                          f"{type(self.logprob_token_ids).__name__}")
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = 0
        if self.guided_decoding is not None:  # vLLM's older name
            if self.structured_outputs is not None:
                raise InvalidRequestError("guided_decoding: give structured_outputs or guided_decoding, not both")
            self.structured_outputs = StructuredOutputsParams.coerce(self.guided_decoding, "guided_decoding")
            self.guided_decoding = None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.logit_bias, dict):  # OpenAI's JSON keys are strings of ids
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self.validate()
        bias = allowed = None
        if self.logit_bias:
            bias = (np.fromiter(self.logit_bias, dtype=np.int64), np.array(list(self.logit_bias.values()), np.float32))
        if self.allowed_token_ids is not None:
            allowed = np.array(sorted(set(self.allowed_token_ids)), dtype=np.int64)
        self.row_bias = None if bias is None and allowed is None else (*(bias or (None, None)), allowed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, so a bad request is refused before it costs anything."""
        if not is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and not (is_int(self.seed) and -2**63 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be a 64-bit signed integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < -1):
            raise InvalidRequestError(f"logprobs must be an integer >= 0, -1 (every token) or None, "
                                      f"got {self.logprobs!r}")
        if not all(is_int(t) and t >= 0 for t in self.logprob_token_ids or []):
            raise InvalidRequestError(f"logprob_token_ids must be non-negative integers, got {self.logprob_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        self._validate_vllm_fields()
        ref = self.steering_module_ref
        if ref is not None and not isinstance(ref, str):
            if not (isinstance(ref, (tuple, list)) and len(ref) == 2 and isinstance(ref[0], str)
                    and is_number(ref[1]) and math.isfinite(ref[1])):
                raise InvalidRequestError(f"steering_module_ref must be 'name' or ('name', scale) with a finite "
                                          f"scale, got {ref!r}")


    def _validate_vllm_fields(self) -> None:
        """vLLM's fields: the implemented ones checked, the others refused by name."""
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise InvalidRequestError(f"prompt_logprobs must be an integer >= 0 or None (-1, every vocabulary "
                                      f"entry, is not supported for prompt positions), got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got "
                                          f"{type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise InvalidRequestError(f"logit_bias: {token!r} is not a token id")
                if not is_number(bias) or not -100 <= bias <= 100:
                    raise InvalidRequestError(f"logit_bias: the bias of token {token} must be in [-100, 100], "
                                              f"got {bias!r}")
        if self.allowed_token_ids is not None and not (
                isinstance(self.allowed_token_ids, (list, tuple)) and self.allowed_token_ids
                and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                      f"{self.allowed_token_ids!r}")
        t = self.truncate_prompt_tokens
        if t is not None and not (is_int(t) and (t >= 1 or t == -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be an integer >= 1, -1 (max_model_len) or None, "
                                      f"got {t!r}")
        for name in ("include_stop_str_in_output", "spaces_between_special_tokens", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.spaces_between_special_tokens:
            raise InvalidRequestError("spaces_between_special_tokens=False: not supported (special tokens are "
                                      "decoded as the tokenizer decodes them)")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of: not supported (only best_of == n, got best_of={self.best_of!r}, "
                                      f"n={self.n}); ask for n completions and rank them by cumulative_logprob")
        if self.bad_words:
            raise InvalidRequestError("bad_words: not supported; use logit_bias with -100 for single-token words")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs: must be a StructuredOutputsParams")
            self.structured_outputs.validate()


def _token_key(key: Any) -> Any:
    """A ``logit_bias`` key as an int when it is the decimal string of one (left as is otherwise,
    for the check to name)."""
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return key
