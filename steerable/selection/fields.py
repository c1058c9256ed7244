"""The fields of a :class:`~steerable.selection.SelectSpec` and the strict conversions that
validate them: each error names its field (``select.<name>``), and values are canonicalised
(sorted de-duplicated tuples, ``(start, stop)`` windows) so equal specs compare and hash equal."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from steerable.errors import InvalidRequestError

_ALL = "all"

# Field groups (the include names; each has an ``exclude_`` twin).
_SCOPE_FIELDS = ("prompt", "generation")
_WINDOW_FIELDS = ("prompt_window", "generation_window")
_INT_LIST_FIELDS = (
    "prompt_positions",
    "prompt_tokens",
    "generation_positions",
    "generation_tokens",
    "positions",
)
# Int-list fields whose values must be non-negative.
_NON_NEGATIVE_LISTS = ("prompt_tokens", "generation_positions", "generation_tokens", "positions")

_INCLUDE_FIELDS = (
    "prompt",
    "generation",
    "prompt_positions",
    "prompt_window",
    "prompt_tokens",
    "generation_positions",
    "generation_window",
    "generation_tokens",
    "positions",
)
_EXCLUDE_FIELDS = tuple("exclude_" + f for f in _INCLUDE_FIELDS)

#: Every field name, in canonical (wire/repr) order.
SELECT_FIELDS: tuple[str, ...] = _INCLUDE_FIELDS + _EXCLUDE_FIELDS

#: ``SelectSpec.parse`` shortcuts.
SHORTCUTS: dict[str, dict[str, Any]] = {
    "all": {"prompt": _ALL, "generation": _ALL},
    "all_prompt": {"prompt": _ALL},
    "last_prompt": {"prompt_positions": (-1,)},
    "all_generated": {"generation": _ALL},
}

# Bound on any position / token id / window bound (keeps every derived
# quantity, e.g. P + step, comfortably inside int64).
_MAX_ABS = 1 << 62


def _base(name: str) -> str:
    return name[len("exclude_"):] if name.startswith("exclude_") else name


def _err(name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"select.{name}: {msg}")


def _as_int(value: Any, name: str, what: str) -> int:
    """Strict int conversion: ints, numpy integers and 0-d integer tensors.
    bool, floats (even integral ones) and everything else are rejected."""
    if isinstance(value, (bool, np.bool_)):
        raise _err(name, f"{what} must be an int, got bool {value!r}")
    if isinstance(value, (int, np.integer)):
        out = int(value)
    elif (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.dtype != torch.bool
        and not value.is_floating_point()
        and not value.is_complex()
    ):
        out = int(value.item())
    else:
        raise _err(name, f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not -_MAX_ABS <= out <= _MAX_ABS:
        raise _err(name, f"{what} {out} is out of range (|value| <= 2**62)")
    return out


def _as_int_tuple(value: Any, name: str) -> tuple[int, ...]:
    """Sorted, de-duplicated tuple of ints from a list/tuple/set/range, a 1-D
    integer numpy array or a 1-D integer tensor."""
    what = "element"
    if isinstance(value, torch.Tensor):
        if (
            value.dim() != 1
            or value.dtype == torch.bool
            or value.is_floating_point()
            or value.is_complex()
        ):
            raise _err(
                name,
                f"expected a 1-D integer tensor, got dtype={value.dtype} shape={tuple(value.shape)}",
            )
        items = [_as_int(v, name, what) for v in value.tolist()]
    elif isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise _err(
                name,
                f"expected a 1-D integer array, got dtype={value.dtype} shape={value.shape}",
            )
        items = [_as_int(v, name, what) for v in value.tolist()]
    elif isinstance(value, (list, tuple, set, frozenset, range)):
        items = [_as_int(v, name, what) for v in value]
    else:
        raise _err(
            name,
            "expected a list of ints (list, tuple, set, range, 1-D integer numpy "
            f"array or tensor), got {type(value).__name__} {value!r}",
        )
    out = tuple(sorted(set(items)))
    if _base(name) in _NON_NEGATIVE_LISTS and out and out[0] < 0:
        raise _err(name, f"values must be non-negative, got {out[0]}")
    return out


def _as_window(value: Any, name: str) -> tuple[int, Optional[int]]:
    """Canonical ``(start, stop)``; ``start=None`` becomes 0, ``stop`` may be None."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise _err(name, f"expected a (start, stop) pair, got {value!r}")
    start, stop = value
    start = 0 if start is None else _as_int(start, name, "start")
    stop = None if stop is None else _as_int(stop, name, "stop")
    if _base(name) == "generation_window":
        # Decode steps: the end of generation is unknown, so no negatives.
        if start < 0:
            raise _err(name, f"start must be non-negative (decode steps), got {start}")
        if stop is not None:
            if stop < 0:
                raise _err(name, f"stop must be non-negative or None (decode steps), got {stop}")
            if start >= stop:
                raise _err(name, f"empty window: start {start} >= stop {stop}")
    else:
        # Python slice semantics over the prompt.
        if stop is not None:
            if stop == 0:
                raise _err(name, "stop=0 selects nothing; use None for 'to the end of the prompt'")
            if (start >= 0) == (stop >= 0) and start >= stop:
                raise _err(name, f"empty window: start {start} >= stop {stop}")
    return (start, stop)


def _as_scope(value: Any, name: str) -> Optional[str]:
    if value is None or (isinstance(value, str) and value == _ALL):
        return value
    raise _err(name, f"expected 'all' or None, got {value!r}")
