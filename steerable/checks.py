"""The value checks every validator shares, so a number is judged the same way everywhere."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from steerable.errors import InvalidRequestError

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def all_ints(values: Sequence[Any]) -> bool:
    """Whether every item is an int (bools refused), judged once per distinct type: a prompt of
    thousands of token ids costs one pass in C, not a Python call per token."""
    return all(issubclass(kind, int) and not issubclass(kind, bool) for kind in set(map(type, values)))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(value: Any, where: str) -> float:
    """``value`` as a float, or ``InvalidRequestError`` naming ``where`` (bools, NaN and inf refused)."""
    if not is_number(value) or not math.isfinite(value):
        raise InvalidRequestError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def float32_array(value: Any, where: str) -> np.ndarray:
    """A tensor, array or nested list as a float32 numpy array (a tensor's a view where it can be),
    or ``InvalidRequestError`` naming ``where``."""
    try:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", torch.float32).numpy(force=True)
        return np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise InvalidRequestError(f"{where}: not numeric ({err})") from None


def float_dtype(dtype: str | torch.dtype, where: str) -> torch.dtype:
    """A float dtype by name (``"bfloat16"``, ``"torch.bfloat16"``) or as itself."""
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise InvalidRequestError(f"{where}: unsupported dtype {dtype!r}; expected one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]
