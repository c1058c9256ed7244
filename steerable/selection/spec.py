"""Row selection shared by steering ("which tokens to steer") and capture
("which rows to record").

A *row* is one token input of one request.  For a request whose prompt has
``P`` tokens, the row at absolute sequence position ``p`` is

* a **prompt row** when ``p < P``;
* a **generation row** with *decode step* ``p - P`` otherwise.  Decode step 0
  is the input at position ``P``, i.e. the first generated token.  The last
  sampled token of a request is never fed back, so it is never a row.

A :class:`SelectSpec` is a union of *include* terms minus a union of *exclude*
terms.  When no include term is set the base set is every row, so
``SelectSpec()`` selects everything and ``SelectSpec(exclude_generation="all")``
selects the prompt only.  See :class:`SelectSpec` for the individual fields.

Resolution (:meth:`SelectSpec.mask`) is vectorised and runs every engine step
for each request carrying a selection; everything that depends only on the
prompt length is resolved once per prompt length and cached on the spec.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from steerable.errors import InvalidRequestError
from steerable.selection.fields import (
    _INCLUDE_FIELDS,
    _INT_LIST_FIELDS,
    _SCOPE_FIELDS,
    _WINDOW_FIELDS,
    SELECT_FIELDS,
    SHORTCUTS,
    _as_int_tuple,
    _as_scope,
    _as_window,
    _base,
)
from steerable.selection.sides import INF, Resolved, Side, merge_intervals

__all__ = ["SelectSpec", "SelectLike"]

# Per-spec bound on the number of cached prompt-length resolutions.
_RESOLVE_CACHE_MAX = 1024


@dataclass(frozen=True, kw_only=True, repr=False)
class SelectSpec:
    """Which rows (token inputs) of a request are selected.

    Include fields (all optional; their results are unioned):

    * ``prompt="all"`` -- every prompt row.  ``generation="all"`` -- every
      generation row.  (The only other accepted value is None = unset.)
    * ``prompt_positions`` -- prompt positions; negatives count from the
      prompt end (-1 = ``P - 1``).  Positions outside the prompt select nothing.
    * ``prompt_window=(start, stop)`` -- half-open Python-slice window over the
      prompt (negatives from the end; ``stop=None`` = to the end; ``start=None``
      = 0).  ``stop=0`` and windows empty for every prompt length are rejected.
    * ``prompt_tokens`` -- prompt rows whose input token id is in the set.
    * ``generation_positions`` -- non-negative decode steps.
    * ``generation_window=(start, stop)`` -- half-open over decode steps,
      ``stop=None`` = open-ended; negatives are invalid.
    * ``generation_tokens`` -- generation rows whose input token id is in the set.
    * ``positions`` -- non-negative absolute sequence positions (prompt or
      generation).

    Each has an ``exclude_<field>`` twin; excluded rows are subtracted from the
    included ones.  With no include field set, every row is included.  An
    *empty* include list (e.g. ``positions=[]``) counts as set and selects
    nothing; an empty exclude list is a no-op and is normalised to None.

    Int lists accept lists, tuples, sets, ranges, 1-D integer numpy arrays and
    1-D integer tensors, and are stored as sorted, de-duplicated tuples, so
    specs that differ only in order/duplicates compare (and hash) equal.
    Invalid input raises ``ValueError("select.<field>: ...")``.
    """

    prompt: Optional[str] = None
    generation: Optional[str] = None
    prompt_positions: Optional[tuple[int, ...]] = None
    prompt_window: Optional[tuple[int, Optional[int]]] = None
    prompt_tokens: Optional[tuple[int, ...]] = None
    generation_positions: Optional[tuple[int, ...]] = None
    generation_window: Optional[tuple[int, Optional[int]]] = None
    generation_tokens: Optional[tuple[int, ...]] = None
    positions: Optional[tuple[int, ...]] = None

    exclude_prompt: Optional[str] = None
    exclude_generation: Optional[str] = None
    exclude_prompt_positions: Optional[tuple[int, ...]] = None
    exclude_prompt_window: Optional[tuple[int, Optional[int]]] = None
    exclude_prompt_tokens: Optional[tuple[int, ...]] = None
    exclude_generation_positions: Optional[tuple[int, ...]] = None
    exclude_generation_window: Optional[tuple[int, Optional[int]]] = None
    exclude_generation_tokens: Optional[tuple[int, ...]] = None
    exclude_positions: Optional[tuple[int, ...]] = None

    # ------------------------------------------------------------------ build

    def __post_init__(self) -> None:
        for name in SELECT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            base = _base(name)
            if base in _SCOPE_FIELDS:
                value = _as_scope(value, name)
            elif base in _WINDOW_FIELDS:
                value = _as_window(value, name)
            else:
                value = _as_int_tuple(value, name)
                if not value and name.startswith("exclude_"):
                    value = None  # an empty exclude is a no-op
            object.__setattr__(self, name, value)
        self._init_caches()

    def _init_caches(self) -> None:
        object.__setattr__(self, "_resolved", {})
        object.__setattr__(self, "_prompt_rows", {})  # prompt length -> selected positions (no token terms)
        object.__setattr__(self, "_token_t", {})
        object.__setattr__(self, "_key", None)
        object.__setattr__(
            self, "_has_include", any(getattr(self, f) is not None for f in _INCLUDE_FIELDS)
        )
        object.__setattr__(
            self,
            "_uses_tokens",
            any(
                getattr(self, f) is not None
                for f in ("prompt_tokens", "generation_tokens",
                          "exclude_prompt_tokens", "exclude_generation_tokens")
            ),
        )

    # Pickle / deepcopy without the (possibly device-resident) caches.
    def __getstate__(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in SELECT_FIELDS}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for f in SELECT_FIELDS:
            object.__setattr__(self, f, state.get(f))
        self._init_caches()

    @classmethod
    def parse(cls, value: "SelectLike") -> "SelectSpec":
        """A SelectSpec from a shortcut string, an existing spec (returned as
        is) or a wire dict (see :meth:`from_wire`)."""
        if isinstance(value, SelectSpec):
            return value
        if isinstance(value, str):
            try:
                kwargs = SHORTCUTS[value]
            except KeyError:
                raise InvalidRequestError(
                    f"select: unknown selection {value!r}; valid shortcuts are "
                    f"{', '.join(repr(s) for s in SHORTCUTS)} (or pass a SelectSpec / wire dict)"
                ) from None
            return cls(**kwargs)
        if isinstance(value, Mapping):
            return cls.from_wire(value)
        raise InvalidRequestError(
            f"select: expected a shortcut string ({', '.join(repr(s) for s in SHORTCUTS)}), "
            f"a SelectSpec or a wire dict, got {type(value).__name__} {value!r}"
        )

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "SelectSpec":
        """Inverse of :meth:`to_wire`.  Unknown keys are rejected; None values
        mean unset; values are validated as in the constructor."""
        if not isinstance(d, Mapping):
            raise InvalidRequestError(f"select: wire form must be a dict, got {type(d).__name__} {d!r}")
        unknown = sorted(str(k) for k in d if k not in SELECT_FIELDS)
        if unknown:
            raise InvalidRequestError(
                f"select: unknown key(s) {unknown}; valid keys are {list(SELECT_FIELDS)}"
            )
        return cls(**dict(d))

    def to_wire(self) -> dict[str, Any]:
        """Canonical JSON-able dict: only set fields, in canonical order; int
        lists sorted and de-duplicated; windows as ``[start, stop]``."""
        out: dict[str, Any] = {}
        for name in SELECT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @property
    def key(self) -> str:
        """Stable, hashable identity (canonical JSON of the wire form); equal
        for specs that compare equal.  Suitable as a dict key / hash input."""
        k = self._key
        if k is None:
            k = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_key", k)
        return k

    def __repr__(self) -> str:
        parts = []
        for name in SELECT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, tuple) and _base(name) in _INT_LIST_FIELDS:
                parts.append(f"{name}={list(value)!r}")
            else:
                parts.append(f"{name}={value!r}")
        return f"SelectSpec({', '.join(parts)})"

    __str__ = __repr__

    # -------------------------------------------------------------- resolution

    def _resolve(self, prompt_len: int) -> Resolved:
        r = self._resolved.get(prompt_len)
        if r is not None:
            return r
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len < 0:
            raise InvalidRequestError(f"select: prompt_len must be a non-negative int, got {prompt_len!r}")
        P = int(prompt_len)

        def side(prefix: str) -> Side:
            g = lambda f: getattr(self, prefix + f)  # noqa: E731
            ivs: list[tuple[int, int]] = []
            pts: set[int] = set()
            if g("prompt") is not None:
                ivs.append((0, P))
            if g("generation") is not None:
                ivs.append((P, INF))
            w = g("prompt_window")
            if w is not None:
                a, b, _ = slice(w[0], w[1]).indices(P)
                ivs.append((a, b))
            w = g("generation_window")
            if w is not None:
                ivs.append((P + w[0], INF if w[1] is None else P + w[1]))
            v = g("prompt_positions")
            if v:
                for q in v:
                    q = q + P if q < 0 else q
                    if 0 <= q < P:
                        pts.add(q)
            v = g("generation_positions")
            if v:
                pts.update(P + s for s in v)
            v = g("positions")
            if v:
                pts.update(v)
            return Side(
                merge_intervals(ivs),
                tuple(sorted(pts)),
                g("prompt_tokens") or None,
                g("generation_tokens") or None,
            )

        r = Resolved(self._has_include, side(""), side("exclude_"))
        if len(self._resolved) >= _RESOLVE_CACHE_MAX:
            self._resolved.clear()
        self._resolved[P] = r
        return r

    def _tokens_tensor(self, tokens: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (tokens, device)
        t = self._token_t.get(key)
        if t is None:
            t = torch.tensor(tokens, dtype=torch.int64, device=device)
            self._token_t[key] = t
        return t

    def _side_mask(
        self,
        s: Side,
        positions: torch.Tensor,
        P: int,
        token_ids: Optional[torch.Tensor],
        lo: int,
        hi: int,
    ) -> Optional[torch.Tensor]:
        """OR of the side's terms over rows in [lo, hi], or None if no term can
        match any of them.  (Full interval coverage is handled by the caller.)"""
        acc: Optional[torch.Tensor] = None

        def add(m: torch.Tensor) -> None:
            nonlocal acc
            acc = m if acc is None else acc | m

        for a, b in s.intervals:
            if a > hi or b <= lo:
                continue
            if a <= lo:
                add(positions < b)
            elif b > hi:
                add(positions >= a)
            else:
                add((positions >= a) & (positions < b))
        if s.points and s.points_in(lo, hi):
            add(torch.isin(positions, s.points_tensor(positions.device)))
        if s.prompt_tokens and lo < P:
            m = torch.isin(self._check_tokens(token_ids, positions),
                           self._tokens_tensor(s.prompt_tokens, positions.device))
            add(m & (positions < P) if hi >= P else m)
        if s.gen_tokens and hi >= P:
            m = torch.isin(self._check_tokens(token_ids, positions),
                           self._tokens_tensor(s.gen_tokens, positions.device))
            add(m & (positions >= P) if lo < P else m)
        return acc

    @staticmethod
    def _check_tokens(token_ids: Optional[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        if token_ids is None:
            raise InvalidRequestError("select: token_ids are required to resolve a token-based selection")
        if token_ids.shape != positions.shape:
            raise InvalidRequestError(
                f"select: token_ids shape {tuple(token_ids.shape)} != positions shape {tuple(positions.shape)}"
            )
        return token_ids

    def mask(
        self,
        positions: torch.Tensor,
        prompt_len: int,
        token_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """bool[n]: which of this request's rows are selected.

        ``positions``: int64[n] absolute positions of the rows (any order);
        ``prompt_len``: the request's prompt length P; ``token_ids``: int64[n]
        input token of each row (only read when the spec has token terms; may
        be None otherwise).  The result lives on ``positions.device``.
        """
        n = positions.numel()
        device = positions.device
        if n == 0:
            return torch.zeros(positions.shape, dtype=torch.bool, device=device)
        r = self._resolve(prompt_len)
        P = prompt_len
        if n == 1:
            lo = hi = int(positions.item())
        else:
            lo_t, hi_t = torch.aminmax(positions)
            lo, hi = int(lo_t.item()), int(hi_t.item())
        exc, inc = r.exc, r.inc

        # Exclusions that remove the whole range -> empty.
        if exc.covers(lo, hi):
            return torch.zeros(positions.shape, dtype=torch.bool, device=device)

        if r.has_include:
            if inc.covers(lo, hi):
                selected = None  # everything included
            else:
                selected = self._side_mask(inc, positions, P, token_ids, lo, hi)
                if selected is None:  # no include term reaches these rows
                    return torch.zeros(positions.shape, dtype=torch.bool, device=device)
        else:
            selected = None

        excluded = self._side_mask(exc, positions, P, token_ids, lo, hi)
        if excluded is None:
            if selected is None:
                return torch.ones(positions.shape, dtype=torch.bool, device=device)
            return selected
        return ~excluded if selected is None else selected & ~excluded

    def prompt_positions_selected(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """Every selected prompt position, sorted. Without token terms it depends on the prompt's
        length alone and is kept per length (admission and corpus capture ask for the same ones)."""
        P = len(prompt_token_ids)
        if P == 0:
            return []
        if self.selects_all_from(P) <= 0:  # e.g. "all_prompt": no mask to build
            return list(range(P))
        if not self._uses_tokens and P in self._prompt_rows:
            return list(self._prompt_rows[P])
        positions = torch.arange(P, dtype=torch.int64)
        tokens = torch.as_tensor(prompt_token_ids, dtype=torch.int64).reshape(-1) if self._uses_tokens else None
        selected = torch.nonzero(self.mask(positions, P, tokens)).flatten().tolist()
        if not self._uses_tokens:
            if len(self._prompt_rows) >= _RESOLVE_CACHE_MAX:
                self._prompt_rows.clear()
            self._prompt_rows[P] = tuple(selected)
        return selected

    def selects_prompt(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether any prompt row is selected."""
        P = len(prompt_token_ids)
        if P == 0:
            return False
        positions = torch.arange(P, dtype=torch.int64)
        tokens = torch.as_tensor(prompt_token_ids, dtype=torch.int64).reshape(-1) if self._uses_tokens else None
        return bool(self.mask(positions, P, tokens).any())

    def next_candidate(self, at_least: int, prompt_len: int) -> float:
        """A lower bound on the next selected position >= ``at_least`` (inf when none can follow).

        Excludes are ignored, so the bound is safe: callers use it to skip rows that certainly are
        not selected without resolving them one by one.
        """
        if not self._has_include:
            return at_least
        inc = self._resolve(prompt_len).inc
        best = float("inf")
        for a, b in inc.intervals:
            if b > at_least:
                best = min(best, max(a, at_least))
        i = bisect.bisect_left(inc.points, at_least)
        if i < len(inc.points):
            best = min(best, inc.points[i])
        if inc.prompt_tokens and at_least < prompt_len:
            best = min(best, at_least)
        if inc.gen_tokens:
            best = min(best, max(at_least, prompt_len))
        return best

    def generation_span(self, position: int, prompt_len: int) -> tuple[int, float]:
        """The run of generation rows ``[lo, hi)`` around ``position`` (>= ``prompt_len``) over which
        the selection's decision cannot change when it reads no generated token ids: between two
        boundaries of its windows and position lists. Per-step planning resolves a decode row once
        per run instead of once per step."""
        r = self._resolve(prompt_len)
        lo, hi = prompt_len, float("inf")
        for side in (r.inc, r.exc):
            edges = [e for a, b in side.intervals for e in (a, b)] + [e for q in side.points for e in (q, q + 1)]
            for edge in edges:
                if edge <= position:
                    lo = max(lo, edge)
                elif edge < hi:
                    hi = edge
        return lo, hi

    def selects_all_from(self, prompt_len: int) -> float:
        """The lowest position from which every row is selected whatever its token (inf when no
        such position exists): per-step planning takes the rows from there on without a mask."""
        r = self._resolve(prompt_len)
        start: float = 0
        if r.has_include:
            open_ended = [a for a, b in r.inc.intervals if b == INF]
            start = min(open_ended) if open_ended else float("inf")
        exc = r.exc
        if exc.gen_tokens:
            return float("inf")
        if exc.prompt_tokens:
            start = max(start, prompt_len)
        reaching = [b for a, b in exc.intervals if b > start]
        if reaching:
            start = float("inf") if max(reaching) == INF else max(reaching)
        if exc.points and exc.points[-1] >= start:
            start = exc.points[-1] + 1
        return start

    @property
    def reads_generated_tokens(self) -> bool:
        """Whether selecting a generated row needs that row's token id (not only its position)."""
        return self.generation_tokens is not None or self.exclude_generation_tokens is not None

    def may_select_generation(self) -> bool:
        """Conservative: False only when no generation row can ever be selected
        (for any prompt length, decode step or token)."""
        if self.exclude_generation is not None or self.exclude_generation_window == (0, None):
            return False
        if not self._has_include:
            return True
        return bool(
            self.generation is not None
            or self.generation_window is not None
            or self.generation_positions
            or self.generation_tokens
            or self.positions
        )


#: Anything :meth:`SelectSpec.parse` accepts.
SelectLike = Union[SelectSpec, str, Mapping[str, Any]]
