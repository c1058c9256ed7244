"""Token windows for dictionary training, built as SAELens builds them.

SAELens trains on fixed-length windows cut from a stream of documents
(``sae_lens.tokenization_and_batching.concat_and_batch_sequences`` with
``begin_batch_token_id=BOS, begin_sequence_token_id=None, sequence_separator_token_id=BOS``, the
texts tokenized without special tokens): BOS opens every window and separates documents, a
document that already starts with BOS gets no second one, a document runs on into the next
window (which opens with BOS again), and the last partial window is dropped. Activations captured
on the same windows are then the rows SAELens' own ``ActivationsStore`` would have produced.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


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
