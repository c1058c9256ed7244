"""What users write for the interventions beyond adds and clamps: low-rank and affine edits of the
residual stream (``LowRank`` is LoReFT), conditional steering (``When``) and MoE router steering
(``RouterBias``). ``steering.edits`` checks them against a model and turns them into the canonical
``Intervention`` the engine composes, hashes and loads into tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from steerable.hook_points import POST_MLP


@dataclass(frozen=True)
class LowRank:
    """LoReFT on the selected rows: ``h + R^T (W h + b - R h)`` at ``hook`` of ``layer``.

    ``R`` [r, d] has orthonormal rows (the subspace edited), ``W`` [r, d] and ``b`` [r] (None:
    zeros) the learned projection it is moved to; ``d`` is the hidden size, ``r >= 1``."""

    layer: int
    R: Any
    W: Any
    b: Any = None
    hook: str = POST_MLP
    select: Any = None


@dataclass(frozen=True)
class Affine:
    """``h + (A h + c)`` on the selected rows. ``A`` is a [d, d] matrix, or a tuple ``(U, V)`` of
    [d, r] and [r, d] for the low-rank ``h + U (V h) + c``; ``c`` [d] (None: zeros)."""

    layer: int
    A: Any
    c: Any = None
    hook: str = POST_MLP
    select: Any = None


@dataclass(frozen=True)
class When:
    """Conditional steering: ``items`` apply only where a gate passes. The gate reads
    ``p = (h · direction) / |direction|`` at ``hook`` of ``layer`` (before that point's own edits),
    or, with ``direction`` a ``Feature``, that SAE feature's activation at the SAE's point; it
    passes where ``p > threshold`` (``compare=">"``) or ``p < threshold`` (``"<"``).

    ``scope="token"``: each row whose ``p`` passes gets the items. ``scope="prompt"``: the mean of
    ``p`` over every prompt row decides once, at the end of the prompt, for every row whose input
    is a generated token (the first sampled token is therefore unaffected). The items may sit at
    the gate's point or later ones, never earlier."""

    items: list[Any] = field(default_factory=list)
    layer: int | None = None
    direction: Any = None
    threshold: float = 0.0
    hook: str = POST_MLP
    scope: str = "token"
    compare: str = ">"


@dataclass(frozen=True)
class RouterBias:
    """Add ``bias`` to the router logit of ``expert`` at MoE layer ``layer``, before the top-k
    choice of experts (a positive bias routes more tokens to it, a large negative one none)."""

    layer: int
    expert: int
    bias: float


EDIT_ITEMS = (LowRank, Affine, When, RouterBias)
