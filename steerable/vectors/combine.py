"""llama.cpp's ``--control-vector FILE[:SCALE]`` and ``--control-vector-layer-range START END``:
several files scaled and summed per layer into one ControlVector (shared by ``steerable generate``
and ``steerable serve``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from steerable.errors import InvalidRequestError
from steerable.vectors.control_vector import ControlVector


def parse_control_vector_arg(text: str) -> tuple[str, float]:
    """``"happy.gguf:1.5"`` -> ``("happy.gguf", 1.5)``; without a numeric ``:SCALE`` suffix the
    scale is 1.0 (llama.cpp's ``--control-vector FNAME``)."""
    path, sep, scale = text.rpartition(":")
    if sep:
        try:
            value = float(scale)
        except ValueError:
            value = None
        if value is not None:
            if not math.isfinite(value):
                raise InvalidRequestError(f"control_vector: scale {scale!r} in {text!r} is not finite")
            if not path:
                raise InvalidRequestError(f"control_vector: {text!r} names no file")
            return path, value
    return text, 1.0


def combine_control_vectors(specs: Sequence[str], layer_range: Sequence[int] | None = None,
                            llm: Any = None) -> ControlVector:
    """Load each ``FILE[:SCALE]``, multiply by its scale and sum per layer (as llama.cpp does), then
    keep the layers in the inclusive ``layer_range`` (START, END), applied to the sum. With ``llm``
    the result is checked against the model (width, layer count), naming the offending file."""
    if not specs:
        raise InvalidRequestError("control_vector: at least one FILE[:SCALE] is required")
    if layer_range is not None:
        if len(layer_range) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layer_range) \
                or layer_range[0] > layer_range[1]:
            raise InvalidRequestError(f"control_vector_layer_range: expected START <= END integers, "
                                      f"got {list(layer_range)!r}")
    total = None
    for text in specs:
        path, scale = parse_control_vector_arg(text)
        cv = ControlVector.load(path, llm) * scale
        if total is not None and (cv.width != total.width or cv.hook != total.hook):
            raise InvalidRequestError(f"control_vector: {path} ({cv.width} wide, at {cv.hook}) does not match the "
                                      f"earlier files ({total.width} wide, at {total.hook})")
        total = cv if total is None else total + cv
    return total.in_layer_range(*layer_range) if layer_range is not None else total
