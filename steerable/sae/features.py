"""What users write to steer by SAE feature; ``steering.spec.SpecParser`` resolves both against the
registered SAE at admission (an unknown name or an index out of range is an error naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Feature:
    """``h += scale * W_dec[index]`` at the SAE's point on the selected rows: an additive row, summed
    with the other adds at that point."""

    sae: str
    index: int
    scale: float = 1.0
    select: Any = None


@dataclass(frozen=True)
class FeatureClamp:
    """Set feature ``index``'s activation to ``value`` on the selected rows:
    ``h += strength * (value - a(h)) * W_dec[index]``, with ``a(h)`` the SAE's activation of that
    feature for the row being edited (``SAE.feature_read``). ``value=0`` ablates the feature;
    ``strength`` (in [0, 1]) moves part of the way, as a projection ``Clamp``'s does."""

    sae: str
    index: int
    value: float = 0.0
    select: Any = None
    strength: float = 1.0
