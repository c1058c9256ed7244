"""The pieces of corpus capture below the engine: the shard file filled through its mapped pages
(read back by plain safetensors) and the shard buffer that places each step's rows."""

import errno
import json
import struct
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from steerable.capture import shard_file
from steerable.capture.shard_buffer import ShardBuffer, ShardRouter
from steerable.capture.shard_file import LABELS, ShardFile
from steerable.capture.store import StreamRows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shard_file_is_what_was_copied_into_it(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    layers, rows, width = [2, 10, 11], 7, 5
    expected = {f"layer.{layer}": torch.randn(rows, width, generator=g).to(dtype) for layer in layers}
    expected.update({name: torch.randint(-5, 10**12, (rows,), generator=g) for name in LABELS})
    shard = ShardFile(tmp_path / "s.part", layers, rows, width, dtype, {"format": "x", "note": 'é "q"'})
    shard.allocate(chunk_rows=3)  # several chunks, the last one short
    shard.wait_rows(rows)
    for i, layer in enumerate(layers):
        shard.data[i].copy_(expected[f"layer.{layer}"])
    for j, name in enumerate(LABELS):
        shard.labels[j] = expected[name].numpy()
    del shard  # unmapped; what was copied is the file
    (tmp_path / "s.part").rename(tmp_path / "s.safetensors")
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata() == {"format": "x", "note": 'é "q"'}
    raw = (tmp_path / "s.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert length % 8 == 0 and spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(raw) == 8 + length + spans[-1][1]  # no gap, nothing after the last tensor


def test_shard_file_of_no_rows_and_what_it_refuses(tmp_path):
    shard = ShardFile(tmp_path / "empty.safetensors", [0, 1], 0, 4, torch.bfloat16)
    shard.wait_rows(0)  # nothing to reserve
    shard.allocate()
    assert shard.data.shape == (2, 0, 4) and shard.labels.shape == (3, 0)
    loaded = load_file(tmp_path / "empty.safetensors")
    assert loaded["layer.1"].shape == (0, 4) and loaded["example"].shape == (0,)
    with pytest.raises(ValueError, match="dtype"):
        ShardFile(tmp_path / "x.safetensors", [0], 1, 4, torch.int8)


def test_shard_file_releases_rows_as_they_are_reserved(tmp_path, monkeypatch):
    reserved, released = [], []
    real = shard_file.os.posix_fallocate

    def fallocate(fd, offset, length):
        reserved.append((offset, length))
        if len(reserved) == 5:  # the labels, chunk 0 of both layers, then chunk 1 of layer 0
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(shard_file.os, "posix_fallocate", fallocate)
    shard = ShardFile(tmp_path / "s.part", [0, 1], 10, 4, torch.float32)
    def wait():
        try:
            for n in (0, 4, 8):
                shard.wait_rows(n)
                released.append(n)
        except OSError:
            released.append("refused")

    waiter = threading.Thread(target=wait)
    waiter.start()
    with pytest.raises(OSError, match="No space"):
        shard.allocate(chunk_rows=4)
    waiter.join(timeout=10)
    assert released == [0, 4, "refused"] and not waiter.is_alive()  # rows 4-7 were never granted
    start = shard.start + 3 * 10 * 8
    assert reserved == [(0, start), (start, 64), (start + 160, 64), (start + 64, 64), (start + 224, 64)]
    with pytest.raises(OSError, match="rows up to 8 could not be reserved"):
        shard.wait_rows(8)


def buffer_over(first, counts, layers, width, dtype):
    rows = sum(counts)
    return ShardBuffer(first, counts, torch.empty(layers, rows, width, dtype=dtype), np.empty((3, rows), np.int64))


def step(block_rows: list[int], parts: list[tuple[str, list[int]]], layers: int = 2, width: int = 3):
    """A step whose block row r holds r + 100 * layer, and whose requests take the rows given
    (positions 10 * block row, token ids block row + 7)."""
    block = torch.arange(max(block_rows, default=0) + 1, dtype=torch.float32)[None, :, None] \
        + 100 * torch.arange(layers, dtype=torch.float32)[:, None, None] + torch.zeros(1, 1, width)
    where = np.array([r for _, rows in parts for r in rows], np.int64)
    return StreamRows(block, where, [rid for rid, _ in parts], np.array([len(rows) for _, rows in parts], np.int64),
                      (where * 10).astype(np.int32), (where + 7).astype(np.int32))


def test_buffer_places_rows_by_example_whatever_the_step_order():
    buffer = buffer_over(40, [2, 3, 1], 2, 3, torch.bfloat16)
    for rid, example in (("a", 40), ("b", 41), ("c", 42)):
        buffer.expect(rid, example)
    buffer.append(step([0, 1, 2, 3], [("c", [3]), ("b", [0, 2])]))  # out of example order, gaps in the block
    buffer.append(step([0, 1, 2], [("a", [0, 1]), ("b", [2])]))
    buffer.check_complete()
    assert buffer.data[0, :, 0].tolist() == [0, 1, 0, 2, 2, 3] and buffer.data[1, :2, 0].tolist() == [100, 101]
    example, position, token_id = buffer.labels
    assert example.tolist() == [40, 40, 41, 41, 41, 42]
    assert position.tolist() == [0, 10, 0, 20, 20, 30] and token_id.tolist()[-1] == 10
    with pytest.raises(ValueError, match="6 rows needed, data has 5"):
        ShardBuffer(0, [2, 3, 1], torch.empty(2, 5, 3), np.empty((3, 6), np.int64))


def test_buffer_refuses_rows_it_cannot_place():
    buffer = buffer_over(0, [1, 2], 2, 3, torch.float32)
    buffer.expect("a", 0)
    buffer.expect("b", 1)
    with pytest.raises(RuntimeError, match="request 'z'"):
        buffer.append(step([0], [("z", [0])]))
    with pytest.raises(RuntimeError, match="example 0 got more than its 1"):
        buffer.append(step([0, 1], [("a", [0, 1])]))
    buffer.append(step([0], [("b", [0])]))
    with pytest.raises(RuntimeError, match="example 0 got 0 of its 1"):
        buffer.check_complete()


def test_buffer_keeps_a_storage_failure_for_its_caller():
    def wait_rows(n):
        if n > 1:
            raise OSError("no space for rows up to %d" % n)

    rows = torch.zeros(2, 3, 3)
    buffer = ShardBuffer(0, [1, 2], rows, np.empty((3, 3), np.int64), wait_rows)
    buffer.expect("a", 0)
    buffer.expect("b", 1)
    buffer.append(step([0], [("a", [0])]))
    buffer.check()
    buffer.append(step([0, 1], [("b", [0, 1])]))  # not stored: the engine's step goes on
    assert rows[:, 1:].abs().sum() == 0
    with pytest.raises(OSError, match="rows up to 3"):
        buffer.check()
    with pytest.raises(OSError, match="rows up to 3"):
        buffer.check_complete()


def test_router_splits_a_step_between_shards():
    router = ShardRouter()
    first, second = buffer_over(0, [2, 1], 2, 3, torch.float32), buffer_over(3, [2], 2, 3, torch.float32)
    router.expect("a", first, 0)
    router.expect("b", first, 1)
    router.expect("c", second, 3)
    router.append(step([0, 1, 2, 3, 4], [("a", [0, 1]), ("c", [2]), ("b", [3])]))  # a shard's rows on both sides
    router.append(step([0, 1], [("c", [1])]))
    assert first.complete and second.complete
    assert first.data[0, :, 0].tolist() == [0, 1, 3] and second.data[1, :, 0].tolist() == [102, 101]
    assert first.labels[1].tolist() == [0, 10, 30] and second.labels[0].tolist() == [3, 3]
    router.forget(first)
    with pytest.raises(RuntimeError, match="request 'a', which is not one of this run's"):
        router.append(step([0], [("a", [0])]))
