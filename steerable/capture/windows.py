"""Token windows for dictionary training, built as SAELens builds them.

SAELens trains on fixed-length windows cut from a stream of documents
(``sae_lens.tokenization_and_batching.concat_and_batch_sequences`` with
``begin_batch_token_id=BOS, begin_sequence_token_id=None, sequence_separator_token_id=BOS``, the
texts tokenized without special tokens): BOS opens every window and separates documents, a
document that already starts with BOS gets no second one, a document runs on into the next
window (which opens with BOS again), and the last partial window is dropped. Activations captured
on the same windows are then the rows SAELens' own ``ActivationsStore`` would have produced.
``corpus_windows`` makes a corpus capture's windows: texts packed so, or windows given as token ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from steerable.errors import InvalidRequestError

TOKENIZE_BATCH = 1024  # texts per call into the tokenizer, and windows per array chunk


def token_windows(documents: Iterable[Sequence[int]], context_size: int,
                  bos_token_id: int | None) -> Iterator[list[int]]:
    """Windows of exactly ``context_size`` token ids over ``documents`` (lazily: a corpus of any
    size streams through); ``bos_token_id`` None concatenates documents with no separator."""
    if context_size < 2:  # a window of BOS alone would never advance through a document
        raise ValueError(f"context_size: must be >= 2, got {context_size}")
    window: list[int] | None = None
    for document in documents:
        tokens = list(document)
        offset = 0
        while offset < len(tokens):
            opener = [bos_token_id] if bos_token_id is not None and tokens[offset] != bos_token_id else []
            if window is None:  # BOS opens the window
                take = max(context_size - len(opener), 0)
                window = opener[:context_size] + tokens[offset:offset + take]
            else:  # BOS separates this document from the one before
                room = context_size - len(window)
                take = max(room - len(opener), 0)
                window = window + opener[:room] + tokens[offset:offset + take]
            offset += take
            if len(window) == context_size:
                yield window
                window = None


def tokenize_documents(tokenizer: Any, texts: Sequence[str]) -> Iterator[list[int]]:
    """Each text's token ids without special tokens (``tokenizer``: a transformers tokenizer),
    ``TOKENIZE_BATCH`` texts per call into the Rust tokenizer."""
    for start in range(0, len(texts), TOKENIZE_BATCH):
        yield from tokenizer(list(texts[start:start + TOKENIZE_BATCH]), add_special_tokens=False)["input_ids"]


def corpus_windows(corpus: Sequence[Any], context_size: int, tokenizer: Any, vocab_size: int) -> np.ndarray:
    """``int32 [windows, context_size]`` of a corpus capture: texts are tokenized and packed by
    ``token_windows``; lists of token ids are windows already (each exactly ``context_size`` long)
    and are used as given. ``InvalidRequestError`` naming ``texts`` for anything else."""
    if isinstance(corpus, np.ndarray):
        windows = corpus
    elif all(isinstance(item, str) for item in corpus):
        if tokenizer is None:
            raise InvalidRequestError("texts: this model has no tokenizer; pass token-id windows instead")
        packed = token_windows(tokenize_documents(tokenizer, corpus), context_size, tokenizer.bos_token_id)
        chunks = []  # a few thousand windows at a time: no Python list of the whole corpus
        while chunk := list(itertools.islice(packed, TOKENIZE_BATCH)):
            chunks.append(np.asarray(chunk, dtype=np.int32))
        windows = np.concatenate(chunks) if chunks else np.empty((0, context_size), np.int32)
    elif all(not isinstance(item, str) for item in corpus):
        lengths = {len(item) for item in corpus}
        if lengths != {context_size}:
            raise InvalidRequestError(f"texts: pre-tokenized windows must all hold context_size={context_size} token "
                                      f"ids; got lengths {sorted(lengths)[:5]}")
        windows = np.asarray(corpus)
    else:
        raise InvalidRequestError("texts: expected texts or token-id windows, not a mix of both")
    if windows.ndim != 2 or windows.shape[1] != context_size or not np.issubdtype(windows.dtype, np.integer):
        raise InvalidRequestError(f"texts: token-id windows must be integers of shape [windows, {context_size}], "
                                  f"got {windows.dtype} {tuple(windows.shape)}")
    if not len(windows):
        raise InvalidRequestError(f"texts: the corpus fills no window of {context_size} tokens")
    if windows.min() < 0 or windows.max() >= vocab_size:
        raise InvalidRequestError(f"texts: token ids must lie in [0, {vocab_size}); got ids from {windows.min()} to "
                                  f"{windows.max()}")
    return np.ascontiguousarray(windows, dtype=np.int32)
