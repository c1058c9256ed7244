"""The driver's messages to every rank, and the stages' reports back, over the gloo control groups.

A message travels as one fixed-size frame (kind, length, the first bytes of the payload) and, when
the payload is larger, one more transfer of the rest: a typical step is a single collective.
A gloo send (a broadcast too) completes only when its receiver takes it, so sends here are
asynchronous and each completes before the next one starts: a stage reporting step N while the
driver broadcasts step N + 1 would otherwise wait for each other forever.
"""

from __future__ import annotations

import enum

import numpy as np
import torch
import torch.distributed as dist

FRAME_BYTES = 64 * 1024
_HEAD = 2  # int64 words before the payload: kind, payload length


class Kind(enum.IntEnum):
    STEP = 1
    SHUTDOWN = 2
    REPORT = 3
    FLUSH = 4  # report the step in flight now: the driver waits for it before sending another


def _frame(kind: Kind, payload: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frame and the rest of ``payload``, built with plain memory copies: torch's CPU ops would
    take its thread pool, which on a busy GPU host cost milliseconds per step on the critical path."""
    frame = bytearray(FRAME_BYTES)
    first = min(len(payload), FRAME_BYTES - 8 * _HEAD)
    frame[:8 * _HEAD] = np.array([int(kind), len(payload)], dtype=np.int64).tobytes()
    frame[8 * _HEAD:8 * _HEAD + first] = memoryview(payload)[:first]
    rest = torch.frombuffer(bytearray(memoryview(payload)[first:]), dtype=torch.uint8) if len(payload) > first else None
    return torch.frombuffer(frame, dtype=torch.uint8), rest


def _parse(frame: torch.Tensor) -> tuple[Kind, int, memoryview]:
    data = memoryview(frame.numpy())
    kind, length = np.frombuffer(data[:8 * _HEAD], dtype=np.int64).tolist()
    return Kind(kind), length, data[8 * _HEAD:8 * _HEAD + min(length, FRAME_BYTES - 8 * _HEAD)]


def _join(first: memoryview, rest: torch.Tensor | None) -> memoryview:
    """The payload as one writable buffer of its own (decoded arrays are views of it)."""
    return memoryview(bytearray(first) if rest is None else bytearray(first) + memoryview(rest.numpy()))


class ControlChannel:
    """Rank 0 broadcasts; every other rank receives the same messages in the same order. A
    broadcast completes only once every rank receives it, and the last stage of a pipeline takes
    the next step only after finishing (and reporting) the previous one: so the driver does not
    wait for a message to arrive before running its own part of the step, only before sending
    the next message."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def publish(self, kind: Kind, payload: bytes = b"") -> None:
        self.flush()
        frame, rest = _frame(kind, payload)
        for tensor in (frame, rest) if rest is not None else (frame,):
            self._pending.append((dist.broadcast(tensor, src=0, group=self.group, async_op=True), tensor))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def receive(self) -> tuple[Kind, memoryview]:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.group)
        kind, length, first = _parse(frame)
        rest = None
        if length > len(first):
            rest = torch.empty(length - len(first), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
        return kind, _join(first, rest)


class ReportChannel:
    """A stage's reports to the driver (rank 0), point to point."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, payload: bytes) -> None:
        self.flush()
        frame, rest = _frame(Kind.REPORT, payload)
        for tensor in (frame, rest) if rest is not None else (frame,):
            self._pending.append((dist.isend(tensor, dst=0, group=self.group), tensor))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def receive(self, src: int) -> memoryview:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.recv(frame, src=src, group=self.group)
        kind, length, first = _parse(frame)
        if kind is not Kind.REPORT:
            raise RuntimeError(f"rank {src} sent {kind.name} where a report was due")
        rest = None
        if length > len(first):
            rest = torch.empty(length - len(first), dtype=torch.uint8)
            dist.recv(rest, src=src, group=self.group)
        return _join(first, rest)
