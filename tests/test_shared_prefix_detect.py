"""Which decode rows the step builder marks as sharing a prefix (host side, no kernels)."""

import numpy as np

from steerable.engine.shared_prefix import SharedPrefixDetector

BS = 16


def _table(rows: list[list[int]]) -> np.ndarray:
    table = np.zeros((len(rows) + 1, 12), dtype=np.int64)
    for i, ids in enumerate(rows):
        table[i, :len(ids)] = ids
    return table


def test_whole_shared_blocks_only_and_most_saving_cut():
    det = SharedPrefixDetector(BS, min_tokens=32, min_requests=3)
    # Rows 0-3 share blocks 1, 2 (row 3 also 3 with row 0); row 4 has its own prefix.
    table = _table([[1, 2, 3, 10], [1, 2, 11], [1, 2, 12, 13], [1, 2, 3, 14], [20, 21, 22]])
    slots = np.arange(5)
    lengths = det.detect(table, slots, np.array([60, 40, 50, 64, 45]))
    assert lengths.tolist() == [32, 32, 32, 32, 0]  # 3 blocks for two rows saves less than 2 for four
    # The current token's block is never shared, even where the ids agree (a row at 32 tokens
    # has one whole block before its token, under the 2-block threshold: out of the group).
    lengths = det.detect(table, slots, np.array([60, 32, 50, 64, 45]))
    assert lengths.tolist() == [32, 0, 32, 32, 0]


def test_thresholds_and_slots():
    det = SharedPrefixDetector(BS, min_tokens=32, min_requests=3)
    table = _table([[5, 6, 7], [9, 9], [5, 6, 8], [5, 6, 9, 4]])
    # Slots pick the rows: only two of the step's rows share -> below min_requests.
    assert det.detect(table, np.array([0, 1, 2]), np.array([40, 40, 40])) is None
    lengths = det.detect(table, np.array([3, 0, 2]), np.array([60, 40, 40]))
    assert lengths.tolist() == [32, 32, 32]
    assert SharedPrefixDetector(BS, min_tokens=64, min_requests=3).detect(
        table, np.array([3, 0, 2]), np.array([60, 40, 40])) is None  # 2 blocks < 64 tokens
