"""What a dashboard run is asked for, checked before any work: every bad value is an
``InvalidRequestError`` naming its field. The settings are also what a resumed run, a merged shard
or a server's ``--dashboards`` directory must agree with (``check_same``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.sae.dashboards.merge import POSITION_BITS

FORMAT = "steerable-dashboards-v1"


@dataclass(frozen=True)
class DashboardSettings:
    """One run's parameters and what they were computed for (model, SAE, corpus)."""

    model: str
    sae: str
    sae_sha256: str
    layer: int
    hook: str
    d_sae: int
    architecture: str
    features: list[int] | None  # None: every feature
    n_top: int
    before: int
    after: int
    quantiles: int
    n_quantile: int
    n_logits: int
    bins: int
    seed: int
    exclude_positions: list[int]
    exclude_tokens: list[int]
    num_texts: int
    corpus_sha256: str
    format: str = FORMAT

    @property
    def window(self) -> int:
        return self.before + 1 + self.after

    def feature_ids(self) -> torch.Tensor:
        """The features computed, ascending (int64)."""
        if self.features is None:
            return torch.arange(self.d_sae)
        return torch.tensor(self.features, dtype=torch.long)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Any, where: str) -> "DashboardSettings":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InvalidRequestError(f"{where}: not a dashboards index (expected format {FORMAT!r})")
        try:
            return DashboardSettings(**data)
        except TypeError as err:
            raise InvalidRequestError(f"{where}: malformed dashboards index ({err})") from None

    def check_same(self, other: "DashboardSettings", where: str) -> None:
        """``other`` computes the same dashboards over the same corpus; the first field that differs
        is named (the SAE's hash first: a directory of another SAE is the usual mistake)."""
        mine, theirs = self.to_json(), other.to_json()
        for key in ["sae_sha256", *mine]:
            if mine[key] != theirs[key]:
                raise InvalidRequestError(f"{where}: {key} differs ({theirs[key]!r} there, {mine[key]!r} here)")


def positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise InvalidRequestError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def check_context(context: Any, max_model_len: int) -> tuple[int, int]:
    """``(before, after)``: tokens shown around an example; the window must fit the model's context."""
    if (not isinstance(context, (tuple, list)) or len(context) != 2
            or not all(is_int(c) and c >= 0 for c in context)):
        raise InvalidRequestError(f"context: expected (tokens before, tokens after), two integers >= 0, "
                                  f"got {context!r}")
    before, after = context
    if max_model_len >= 2**POSITION_BITS:
        raise InvalidRequestError(f"llm: dashboards order examples by position in 24 bits; the model's context of "
                                  f"{max_model_len} tokens is longer")
    if before + 1 + after > max_model_len:
        raise InvalidRequestError(f"context: a window of {before} + 1 + {after} tokens is longer than the model's "
                                  f"context ({max_model_len} tokens)")
    return before, after


def check_features(features: Any, d_sae: int) -> list[int] | None:
    """None (every feature) or the distinct indices asked for, ascending."""
    if features is None:
        return None
    if isinstance(features, range):
        features = list(features)
    if isinstance(features, torch.Tensor):
        features = features.tolist()
    if isinstance(features, (str, bytes)) or not isinstance(features, Iterable):
        raise InvalidRequestError(f"features: expected None or a list of feature indices, got {features!r}")
    features = list(features)
    bad = [f for f in features if not is_int(f) or not 0 <= f < d_sae]
    if bad or not features:
        raise InvalidRequestError(f"features: {bad[:5] or 'none'} are not feature indices in [0, {d_sae})")
    if len(set(features)) != len(features):
        raise InvalidRequestError("features: an index is named twice")
    return sorted(features)


def check_indices(values: Any, name: str) -> list[int]:
    """Distinct non-negative integers, ascending."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequestError(f"{name}: expected a list of integers >= 0, got {values!r}")
    values = list(values)
    if not all(is_int(v) and v >= 0 for v in values):
        raise InvalidRequestError(f"{name}: expected integers >= 0, got {values!r}")
    return sorted(set(values))


def check_texts(texts: Any) -> Sequence[Any]:
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) or len(texts) == 0:
        raise InvalidRequestError("texts: expected a non-empty list of texts (strings or token-id lists)")
    return texts


def corpus_hash(texts: Sequence[Any]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(json.dumps(text if isinstance(text, str) else list(text), ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()
