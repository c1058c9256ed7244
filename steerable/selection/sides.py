"""A row selection resolved for one prompt length: each side (include, exclude) as merged
half-open position intervals, explicit positions and token-id sets, which is what
``SelectSpec.mask`` and the span queries read every step."""

from __future__ import annotations

import bisect
from typing import Optional

import torch

# "Open-ended" upper bound of an interval.
INF = 1 << 63


def merge_intervals(ivs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    ivs = sorted(iv for iv in ivs if iv[0] < iv[1])
    out: list[list[int]] = []
    for a, b in ivs:
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


class Side:
    """One side (include or exclude) of a spec, resolved for one prompt length.

    ``intervals``: merged half-open absolute-position intervals (prompt/generation
    scopes and windows); ``points``: sorted absolute positions (explicit position
    lists); ``prompt_tokens`` / ``gen_tokens``: token-id tuples or None.
    """

    __slots__ = ("intervals", "points", "prompt_tokens", "gen_tokens", "_points_t")

    def __init__(self, intervals, points, prompt_tokens, gen_tokens):
        self.intervals: tuple[tuple[int, int], ...] = intervals
        self.points: tuple[int, ...] = points
        self.prompt_tokens: Optional[tuple[int, ...]] = prompt_tokens
        self.gen_tokens: Optional[tuple[int, ...]] = gen_tokens
        self._points_t: dict[torch.device, torch.Tensor] = {}

    def points_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._points_t.get(device)
        if t is None:
            t = torch.tensor(self.points, dtype=torch.int64, device=device)
            self._points_t[device] = t
        return t

    def points_in(self, lo: int, hi: int) -> bool:
        pts = self.points
        i = bisect.bisect_left(pts, lo)
        return i < len(pts) and pts[i] <= hi

    def covers(self, lo: int, hi: int) -> bool:
        """True when the position intervals alone cover every position in [lo, hi]."""
        for a, b in self.intervals:
            if a <= lo and hi < b:
                return True
        return False


class Resolved:
    __slots__ = ("has_include", "inc", "exc")

    def __init__(self, has_include: bool, inc: Side, exc: Side):
        self.has_include = has_include
        self.inc = inc
        self.exc = exc
