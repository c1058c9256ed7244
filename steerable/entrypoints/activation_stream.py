"""``ActivationStream``: activations straight from the engine into a trainer, no disk in between.

The texts are cut into token windows exactly as SAELens cuts them (``capture.windows``), the
engine captures every position of every window on a thread of its own (``capture.window_feed``)
while the trainer consumes, and the rows reach the trainer shuffled through a buffer on its
device, in batches of ``batch_size`` rows: a ``Tensor[B, d_model]`` for one layer, or
``{TransformerLens hook name: Tensor[B, d_model]}`` for several (the rows of one token at every
layer share their index), which are what SAELens' ``SAETrainer`` and ``MultiSAETrainer`` take
from their data provider.

The shuffle is SAELens' mixing buffer made deterministic: rows collect until the buffer holds
``shuffle_buffer``, then a permutation drawn from a generator seeded by ``seed`` (and the epoch)
serves about half of them and keeps the rest to mix with the next; at the end what is left is
served the same way, the last batch possibly short. The permutations are drawn on the CPU, so a
seed gives the same batches on any device and whatever the threads' timing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from steerable.capture.window_feed import WindowFeed
from steerable.capture.windows import token_windows
from steerable.checks import float_dtype, is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import HIDDEN_STATES, POST_MLP, check_hook_point, transformer_lens_name

_AUTO = "auto"


class ActivationStream(torch.utils.data.IterableDataset):
    """One epoch of shuffled activation batches per iteration (see the module docstring).

    ``model_or_llm``: an ``LLM``, or a model that one is built for (on ``device``, with
    ``engine_kwargs``; eager, so the engine never captures a CUDA graph while the trainer runs;
    closed by ``close``). ``texts``: strings (tokenized without special tokens) or token-id lists,
    any iterable (a generator streams; iterate the stream again only over a re-iterable one).
    ``bos_token_id``: the window opener and separator (default: the tokenizer's BOS; None for
    none). ``dtype``: of the rows (default the model's). ``shuffle_buffer=0`` keeps window order.
    """

    def __init__(self, model_or_llm: Any, texts: Iterable[str | Sequence[int]], *, layers: Sequence[int],
                 hook: str = POST_MLP, context_size: int = 128, batch_size: int = 4096,
                 shuffle_buffer: int = 65536, seed: int = 0, device: str | torch.device = "cuda",
                 dtype: str | torch.dtype | None = None, bos_token_id: int | None | str = _AUTO,
                 drop_last: bool = False, engine_kwargs: dict[str, Any] | None = None):
        super().__init__()
        self.device = torch.device(device)
        if isinstance(model_or_llm, str):
            from steerable.entrypoints.llm import LLM

            self.llm, self._owned = LLM(model_or_llm, device=self.device.type,
                                        **{"enforce_eager": True, **(engine_kwargs or {})}), True
        else:
            self.llm, self._owned = model_or_llm, False
        engine = self.llm.llm_engine
        num_layers = engine.model_config.num_layers
        self.layers = _layers(layers, num_layers)
        self.hook = check_hook_point(hook, "hook")
        if not is_int(context_size) or not 2 <= context_size < engine.max_model_len:
            raise InvalidRequestError(f"context_size: must be an integer in [2, {engine.max_model_len - 1}] (the "
                                      f"model's context, less the token a request generates), got {context_size!r}")
        for name, value, low in (("batch_size", batch_size, 1), ("shuffle_buffer", shuffle_buffer, 0), ("seed", seed, 0)):
            if not is_int(value) or value < low:
                raise InvalidRequestError(f"{name}: must be an integer >= {low}, got {value!r}")
        if 0 < shuffle_buffer < batch_size:
            raise InvalidRequestError(f"shuffle_buffer: must be 0 (no shuffle) or at least batch_size "
                                      f"({batch_size}), got {shuffle_buffer}")
        self.context_size, self.batch_size, self.shuffle_buffer = context_size, batch_size, shuffle_buffer
        self.seed, self.drop_last, self.texts = seed, drop_last, texts
        self.dtype = engine.dtype if dtype is None else float_dtype(dtype, "dtype")
        tokenizer = engine.tokenizer
        if bos_token_id == _AUTO:
            bos_token_id = tokenizer.hf.bos_token_id if tokenizer.available else None
        if bos_token_id is not None and not is_int(bos_token_id):
            raise InvalidRequestError(f"bos_token_id: expected a token id, None or 'auto', got {bos_token_id!r}")
        self.bos_token_id = bos_token_id
        self.hook_names = [transformer_lens_name(layer, hook) for layer in self.layers]
        self.d_in = engine.model_config.hidden_size
        # Engine work per chunk: about one step's token budget; two chunks in the engine keep its
        # steps full while the finished one is handed over.
        self._chunk_windows = max(1, engine.config.max_num_batched_tokens // context_size)
        self._epoch = 0
        self._feed: WindowFeed | None = None  # the open pass

    def close(self) -> None:
        """End a pass still open (a trainer that stopped before the epoch's end holds one until
        its iterator is closed or collected), freeing what it holds in the engine; shut the engine
        down if this stream built it (an ``LLM`` passed in stays open)."""
        if self._feed is not None:
            self._feed.close()
        if self._owned:
            self.llm.shutdown()

    def __enter__(self) -> ActivationStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[torch.Tensor | dict[str, torch.Tensor]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("ActivationStream runs its engine in the process that iterates it: use it directly "
                               "or through DataLoader(stream, batch_size=None) with num_workers=0")
        if self._feed is not None:
            raise RuntimeError("ActivationStream: a pass is open (one engine serves one pass at a time): finish it, "
                               "close its iterator or call close()")
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> Iterator[torch.Tensor | dict[str, torch.Tensor]]:
        engine = self.llm.llm_engine
        if engine.capture_status(HIDDEN_STATES)["enabled"]:
            raise InvalidRequestError("ActivationStream: the hidden_states capture stream is running (the stream "
                                      "records through it): stop it, or end the pass of another ActivationStream "
                                      "on this LLM (close its iterator or call its close())")
        windows = token_windows(self._documents(), self.context_size, self.bos_token_id)
        feed = self._feed = WindowFeed(engine, windows, self.layers, self.hook, self.dtype, self._chunk_windows,
                                       2 * self._chunk_windows).start()
        seed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
        try:
            for batch in _MixingBuffer(self, torch.Generator().manual_seed(seed)).batches(feed):
                yield self._split(batch)
        finally:
            feed.close()
            self._feed = None

    def _documents(self) -> Iterator[Sequence[int]]:
        tokenizer = self.llm.llm_engine.tokenizer
        for i, text in enumerate(self.texts):
            if isinstance(text, str):
                yield tokenizer.encode(text, add_special_tokens=False)
            elif isinstance(text, Sequence) and all(is_int(t) for t in text):
                yield text
            else:
                raise InvalidRequestError(f"texts[{i}]: expected a string or a list of token ids, "
                                          f"got {type(text).__name__}")

    def _split(self, batch: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if len(self.layers) == 1:
            return batch
        d = self.d_in
        return {name: batch[:, i * d:(i + 1) * d] for i, name in enumerate(self.hook_names)}


class _MixingBuffer:
    """The shuffle of one epoch (see the module docstring): ``buffer[:n]`` on the device holds the
    rows not yet served, every layer of a row side by side."""

    def __init__(self, stream: ActivationStream, generator: torch.Generator):
        self.stream, self.generator = stream, generator
        self.device = stream.device
        self.pin = self.device.type == "cuda"
        self.buffer: torch.Tensor | None = None
        self.n = 0

    def batches(self, feed: WindowFeed) -> Iterator[torch.Tensor]:
        stream = self.stream
        size, batch = stream.shuffle_buffer, stream.batch_size
        threshold = max(size, batch)
        while (chunk := feed.next_chunk()) is not None:
            self._add(chunk)
            if self.n >= threshold:
                # Serve about half the buffer, keep the rest to mix with the rows to come.
                count = max(1, (self.n - size // 2) // batch) * batch if size else self.n // batch * batch
                yield from self._serve(count)
        tail = self.n if not stream.drop_last else self.n // batch * batch
        yield from self._serve(tail)

    def _add(self, chunk: torch.Tensor) -> None:
        rows = len(chunk)
        if self.buffer is None or self.n + rows > len(self.buffer):
            grown = torch.empty(max(self.stream.shuffle_buffer, self.stream.batch_size) + 2 * rows, chunk.shape[1],
                                dtype=chunk.dtype, device=self.device)
            if self.buffer is not None:
                grown[:self.n] = self.buffer[:self.n]
            self.buffer = grown
        self.buffer[self.n:self.n + rows].copy_(chunk, non_blocking=self.pin)
        self.n += rows

    def _serve(self, count: int) -> Iterator[torch.Tensor]:
        """``count`` rows of a permutation of ``buffer[:n]`` in batches (the last may be short); the
        rest moves to the front."""
        if count <= 0:
            return
        order = torch.randperm(self.n, generator=self.generator) if self.stream.shuffle_buffer else \
            torch.arange(self.n)
        if self.pin:
            order = order.pin_memory()
        order = order.to(self.device, non_blocking=self.pin)
        batch = self.stream.batch_size
        for start in range(0, count, batch):
            yield self.buffer.index_select(0, order[start:min(start + batch, count)])
        kept = order[count:]
        self.buffer[:len(kept)] = self.buffer.index_select(0, kept)
        self.n = len(kept)


def _layers(layers: Any, num_layers: int) -> list[int]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise InvalidRequestError(f"layers: expected a non-empty list of layer indices, got {layers!r}")
    bad = [layer for layer in layers if not is_int(layer) or not 0 <= layer < num_layers]
    if bad:
        raise InvalidRequestError(f"layers: {bad} not layer indices in [0, {num_layers})")
    if len(set(layers)) != len(layers):
        raise InvalidRequestError(f"layers: {list(layers)} names a layer twice")
    return sorted(layers)

