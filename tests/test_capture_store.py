"""The stream store on its own: a step's rows of every layer arrive as one block, are kept in order
with their labels across chunk boundaries and budgets, come back as views or one concatenation,
drain by request, reduce per request, and serialise to the wire format losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steerable.capture.rowlog import RowLog
from steerable.capture.serialization import deserialize_captured
from steerable.capture.store import StreamConfig, StreamRows, StreamStore

LAYERS = [0, 3]


def _steps(num_steps: int, requests: list[str], width: int = 8, dtype=torch.float32):
    """Decode-like steps: one row per request per step, values 1000 * (index of the layer) +
    100 * (index of the request) + step."""
    for step in range(num_steps):
        n = len(requests)
        block = torch.stack([torch.arange(n)[:, None].float() * 100 + step + layer * 1000 + torch.zeros(n, width)
                             for layer in range(len(LAYERS))]).to(dtype)
        yield StreamRows(block, np.arange(n), list(requests), np.ones(n, np.int64), np.full(n, step, np.int32),
                         np.arange(n, dtype=np.int32) + 7)


def test_rows_in_computed_order_across_chunks_and_views():
    store = StreamStore(StreamConfig(LAYERS, None, "all", "all", None), LAYERS, {})
    for rows in _steps(600, ["a-00000001", "b-00000002"]):  # 1200 rows: two chunks of the log
        store.append(rows)
    assert len(store.groups) == 1 and len(store.groups[0].log.chunks) == 2
    tensors, metas = store.fetch(clear_selected=True)
    assert tensors[3].shape == (1200, 8) and tensors[3][:, 0].tolist()[:4] == [1000.0, 1100.0, 1001.0, 1101.0]
    assert metas[0].positions.tolist()[:4] == [0, 0, 1, 1] and metas[0].req_ids[:2] == ["a-00000001", "b-00000002"]
    order = metas[0].by_request()
    assert metas[0].select(order).positions.tolist() == list(range(600)) * 2
    assert store.tokens_stored == 0 and store.status()["requests"] == 0
    small = StreamStore(StreamConfig(LAYERS, None, "all", "all", None), LAYERS, {})
    small.append(next(_steps(1, ["a"])))
    peek, _ = small.fetch(clear_selected=False)
    assert peek[3].data_ptr() == small.groups[0].log.chunks[0][1].data_ptr()  # a view, no copy


def test_drain_one_request_budget_and_wire_round_trip():
    store = StreamStore(StreamConfig(LAYERS, None, "all", "all", 25), LAYERS, {0: {"width": 8}, 3: {"width": 8}})
    for rows in _steps(10, ["a-00000001", "b-00000002", "c-00000003"]):
        store.append(rows)
    assert store.status()["rows_stored"] == {0: 25, 3: 25} and store.tokens_dropped == 2 * 5
    wire = store.serialize(layers=[3])
    tensors, metas = deserialize_captured(wire)
    peek, peek_meta = store.fetch(layers=[3], clear_selected=False)
    assert torch.equal(tensors[3], peek[3]) and metas[3] == peek_meta[3]
    b_rows, b_meta = store.fetch(req_ids=["b"], clear_selected=True)
    assert set(b_meta[0].req_ids) == {"b-00000002"} and b_meta[0].positions.tolist() == list(range(8))
    assert (b_rows[0][:, 0] == torch.arange(8) + 100).all()
    rest, rest_meta = store.fetch(clear_selected=True)
    assert len(rest_meta[0]) == 25 - 8 and "b-00000002" not in rest_meta[0].req_ids


def test_draining_some_layers_keeps_the_others():
    store = StreamStore(StreamConfig(LAYERS, None, "all", None, 6), LAYERS, {})
    steps = _steps(5, ["a", "b"])
    for _ in range(2):
        store.append(next(steps))
    drained, _ = store.fetch(layers=[3], req_ids=["a"], clear_selected=True)
    assert drained[3][:, 0].tolist() == [1000.0, 1001.0]
    for rows in steps:  # layer 3 has room for two more rows than layer 0
        store.append(rows)
    assert store.status()["rows_stored"] == {0: 6, 3: 6} and store.tokens_dropped == 4 + 2
    tensors, metas = store.fetch(clear_selected=False)
    assert tensors[0][:, 0].tolist() == [0.0, 100.0, 1.0, 101.0, 2.0, 102.0]
    assert tensors[3][:, 0].tolist() == [1100.0, 1101.0, 1002.0, 1102.0, 1003.0, 1103.0]
    assert metas[3].req_ids == ["b", "b", "a", "b", "a", "b"] and metas[0].positions.tolist() == [0, 0, 1, 1, 2, 2]
    assert list(tensors) == LAYERS


def test_reductions_per_request():
    for reduce in ("mean", "last"):
        store = StreamStore(StreamConfig(LAYERS, None, reduce, None, None), LAYERS, {})
        for rows in _steps(4, ["a", "b"]):
            store.append(rows)
        assert store.pending_requests() == ["a", "b"] and store.status()["pending_reductions"] == 4
        store.finish_request("b")
        store.abort_request("a")
        tensors, metas = store.fetch(clear_selected=True)
        assert metas[0].req_ids == ["b"] and store.pending_requests() == []
        expected = 100 + (1.5 if reduce == "mean" else 3.0)
        assert tensors[0][0, 0].item() == expected and tensors[3][0, 0].item() == expected + 1000
        assert metas[3].positions.tolist() == ([-1] if reduce == "mean" else [3])


@pytest.mark.parametrize("pinned", [False, pytest.param(True, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device")])])
def test_row_log_gathers_subsets_across_chunks(pinned):
    log = RowLog(2, pin_memory=pinned)
    source = torch.arange(3000, dtype=torch.float32)[:, None].repeat(1, 4)
    if pinned:  # as a step's rows arrive on a CUDA machine: copied from the device's block
        source = source.cuda()
    source = torch.stack([source, -source])
    for start in range(0, 3000, 300):
        log.append(source[:, start:start + 300], None, np.arange(start, start + 300), np.zeros(300, np.int32),
                   np.zeros(300, np.int32))
    assert len(log.chunks) == 2 and len(log) == 3000 and all(c.is_pinned() == pinned for c in log.chunks)
    pick = np.array([0, 5, 1023, 1024, 2999])
    assert log.rows(0, pick)[:, 0].tolist() == pick.tolist() and log.rows(1, pick)[:, 0].tolist() == (-pick).tolist()
    log.keep(np.arange(3000) % 2 == 1)
    assert len(log) == 1500 and log.rows(1)[:3, 0].tolist() == [-1.0, -3.0, -5.0] and log.labels()[0][0] == 1


def test_row_log_chunks_stop_growing_at_their_cap(monkeypatch):
    """A long run holds at most one chunk it does not fill (what it pins stays near what it stores)."""
    monkeypatch.setattr("steerable.capture.rowlog._MAX_CHUNK_BYTES", 4096 * 16)
    log = RowLog(1)
    source = torch.arange(20000, dtype=torch.float32)[None, :, None].repeat(1, 1, 4)  # 16 bytes a row: cap 4096
    for start in range(0, 20000, 300):
        rows = source[:, start:start + 300]
        k = rows.shape[1]
        log.append(rows, None, np.arange(start, start + k), np.zeros(k, np.int32), np.zeros(k, np.int32))
    capacities = [c.untyped_storage().nbytes() // 16 for c in log.chunks]  # a full chunk is trimmed to its rows
    assert capacities[:2] == [1024, 4096] and max(capacities) == 4096
    assert sum(capacities) < len(log) + 4096
    assert log.rows(0)[:, 0].tolist() == list(range(20000))
    assert log.rows(0, np.array([0, 1024, 5119, 5120, 19999]))[:, 0].tolist() == [0, 1024, 5119, 5120, 19999]
