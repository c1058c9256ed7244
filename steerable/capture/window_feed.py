"""Token windows through an engine on a thread of their own, their activations handed out in
window order: the producer side of ``ActivationStream``.

The thread keeps the engine fed (at most ``in_flight`` windows in it), records every prompt row of
every window through one capture stream whose sink places each row straight into its chunk (a
``ShardBuffer`` over a host tensor ``[rows, layers, width]``, pinned when the engine is on a GPU,
so the consumer's copy to the device is asynchronous), and hands each finished chunk over in
order. At most ``READY_CHUNKS`` chunks wait for the consumer; beyond that the thread pauses
between engine steps. Which windows run together in a step depends only on the engine (windows
are added whenever fewer than ``in_flight`` are in it, never on the consumer's pace), so the rows
of a run are the same whatever the timing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerable.capture.shard_buffer import ShardBuffer, ShardRouter
from steerable.capture.shard_file import LABELS
from steerable.hook_points import HIDDEN_STATES, layers_needed
from steerable.long_runs import frozen_heap, quick_handoff
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

READY_CHUNKS = 4  # finished chunks waiting for the consumer before the engine pauses
_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # prompt rows only: the sampled token is never an input
_EVERY_PROMPT_ROW = SelectSpec(prompt="all")


@dataclass
class _Chunk:
    host: torch.Tensor  # [rows, layers, width]
    buffer: ShardBuffer  # places rows into ``host`` (viewed as [layers, rows, width])
    unfinished: int  # its windows still in the engine or not yet added


class WindowFeed:
    """Captures ``hook`` at ``layers`` on every position of each window of ``windows`` (token-id
    lists of one length) with ``engine``, on a thread started by ``start``. ``next_chunk``
    returns the next ``chunk_windows`` windows' rows, ``[windows * length, layers * width]`` in
    window-then-position order (the last chunk may hold fewer windows), or None after the last;
    an error of the thread is raised there. ``close`` stops the thread and frees what it held in
    the engine. The engine must not be used by anyone else meanwhile."""

    def __init__(self, engine: Any, windows: Iterator[list[int]], layers: Sequence[int], hook: str,
                 dtype: torch.dtype, chunk_windows: int, in_flight: int):
        self.engine, self.windows, self.layers, self.hook, self.dtype = engine, windows, list(layers), hook, dtype
        self.chunk_windows, self.in_flight = chunk_windows, in_flight
        self.width = engine.model_config.hidden_size
        self.pin = engine.device.type == "cuda"
        self.router = ShardRouter()
        self.open: deque[_Chunk] = deque()  # oldest first
        self.in_engine: dict[str, _Chunk] = {}  # client id -> its chunk
        self.ready: deque[torch.Tensor] = deque()
        self.cond = threading.Condition()
        self.stopping = self.done = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="steerable-window-feed", daemon=True)

    def start(self) -> WindowFeed:
        self.thread.start()
        return self

    def next_chunk(self) -> torch.Tensor | None:
        with self.cond:
            self.cond.wait_for(lambda: self.ready or self.done)
            if self.ready:
                chunk = self.ready.popleft()
                self.cond.notify_all()
                return chunk
            if self.error is not None:
                raise self.error
            return None

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            device = self.engine.device
            # The engine's kernels share the consumer's stream (the engine allocates and frees on the
            # stream current at the time; a stream of its own would let the consumer's allocations
            # reuse memory the engine's pending kernels still read); the host work of both overlaps.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                with frozen_heap(), quick_handoff(device.type):
                    self._capture()
        except BaseException as err:  # raised to the consumer by next_chunk
            self.error = err
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _capture(self) -> None:
        engine = self.engine
        engine.start_capture(HIDDEN_STATES, self.layers, self.dtype, "all", _EVERY_PROMPT_ROW, None, self.hook,
                             sink=self.router)
        try:
            try:
                feed = self._feed()
                while not self.stopping:
                    while len(self.in_engine) < self.in_flight and self._add(next(feed, None)):
                        pass
                    if not self.in_engine:
                        break
                    for out in engine.step():
                        if out.finished and out.request_id in self.in_engine:
                            self.in_engine.pop(out.request_id).unfinished -= 1
                    self._hand_over()
                    with self.cond:  # the consumer is far enough behind: pause between steps
                        self.cond.wait_for(lambda: len(self.ready) < READY_CHUNKS or self.stopping)
            finally:
                if self.in_engine:  # stopped early, or failed: free what the windows hold
                    engine.abort_request(list(self.in_engine))
                engine.finish_inflight()  # rows of finished steps: delivered before the stream stops
        finally:
            engine.stop_capture(HIDDEN_STATES)  # returns once the sink has stored every row
        if not self.stopping:
            self._hand_over()
            if self.open:
                self.open[0].buffer.check_complete()  # raises: a window got fewer rows than its length

    def _feed(self) -> Iterator[tuple[_Chunk, int, list[int]]]:
        """(chunk, window index, window) in order, a chunk opened as its first window's turn comes."""
        first = 0
        while group := list(itertools.islice(self.windows, self.chunk_windows)):
            length = len(group[0])
            rows = len(group) * length
            host = torch.empty(rows, len(self.layers), self.width, dtype=self.dtype, pin_memory=self.pin)
            labels = np.empty((len(LABELS), rows), np.int64)
            chunk = _Chunk(host, ShardBuffer(first, [length] * len(group), host.permute(1, 0, 2), labels),
                           len(group))
            self.open.append(chunk)
            for i, window in enumerate(group):
                yield chunk, first + i, window
            first += len(group)

    def _add(self, item: tuple[_Chunk, int, list[int]] | None) -> bool:
        if item is None:
            return False
        chunk, index, window = item
        group = self.engine.add_request(f"window-{index}", window, _PARAMS,
                                        stop_at_layer=layers_needed(self.layers, self.hook))
        self.in_engine[group.client_id] = chunk
        self.router.expect(group.children[0].request_id, chunk.buffer, index)
        return True

    def _hand_over(self) -> None:
        """The oldest chunks whose windows are done and whose rows are all stored, in order."""
        while self.open and self.open[0].unfinished == 0 and self.open[0].buffer.complete:
            chunk = self.open.popleft()
            self.router.forget(chunk.buffer)
            with self.cond:
                self.ready.append(chunk.host.view(chunk.host.shape[0], -1))
                self.cond.notify_all()
        for chunk in self.open:
            chunk.buffer.check()
