"""The pieces of corpus capture below the engine: the safetensors writer (the bytes ``save_file``
writes, read back by ``safe_open``) and the shard buffer that places each step's rows."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from steerable.capture import shard_file
from steerable.capture.shard_buffer import ShardBuffer
from steerable.capture.shard_file import write_safetensors
from steerable.capture.store import StreamRows


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer.10": torch.randn(5, 6, generator=g).to(torch.bfloat16),
            "layer.2": torch.randn(7, 6, generator=g).to(torch.bfloat16),
            "example": torch.arange(7), "position": torch.arange(7) * 3, "half": torch.randn(3, generator=g).half(),
            "single": torch.randn(2, 2, generator=g), "empty": torch.empty(0, 6, dtype=torch.bfloat16),
            "scalar": torch.tensor(1.5, dtype=torch.float64), "mask": torch.tensor([True, False])}


@pytest.mark.parametrize("metadata", [None, {"format": "steerable-corpus-v1"}, {"note": 'é "quoted"'}])
def test_writer_bytes_equal_save_file(tmp_path, metadata):
    tensors = mixed_tensors()
    save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_writer_slices_over_threads_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_file, "SLICE_BYTES", 40)  # every tensor in several slices, written by three threads
    monkeypatch.setattr(shard_file, "WRITE_THREADS", 3)
    tensors = mixed_tensors()
    tensors["big"] = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    written = []
    real = shard_file.os.pwrite
    monkeypatch.setattr(shard_file.os, "pwrite", lambda fd, data, at: written.append(at) or real(fd, data, at))
    write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "x"})
    assert len(written) > 100
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "x"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert f.metadata() == {"format": "x"} and set(f.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)


def test_writer_rejects_what_it_cannot_write_as_is(tmp_path):
    with pytest.raises(ValueError, match="layer.0: expected a contiguous CPU tensor"):
        write_safetensors(tmp_path / "x.safetensors", {"layer.0": torch.zeros(4, 3).t()})
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})


def step(block_rows: list[int], parts: list[tuple[str, list[int]]], layers: int = 2, width: int = 3):
    """A step whose block row r holds r + 100 * layer, and whose requests take the rows given
    (positions 10 * block row, token ids block row + 7)."""
    block = torch.arange(max(block_rows, default=0) + 1, dtype=torch.float32)[None, :, None] \
        + 100 * torch.arange(layers, dtype=torch.float32)[:, None, None] + torch.zeros(1, 1, width)
    where = np.array([r for _, rows in parts for r in rows], np.int64)
    return StreamRows(block, where, [rid for rid, _ in parts], np.array([len(rows) for _, rows in parts], np.int64),
                      (where * 10).astype(np.int32), (where + 7).astype(np.int32))


def test_buffer_places_rows_by_example_whatever_the_step_order():
    buffer = ShardBuffer(2, 3, torch.bfloat16)
    buffer.reset(40, [2, 3, 1])
    for rid, example in (("a", 40), ("b", 41), ("c", 42)):
        buffer.expect(rid, example)
    buffer.append(step([0, 1, 2, 3], [("c", [3]), ("b", [0, 2])]))  # out of example order, gaps in the block
    buffer.append(step([0, 1, 2], [("a", [0, 1]), ("b", [2])]))
    buffer.check_complete()
    tensors = buffer.tensors([4, 9])
    assert tensors["layer.4"][:, 0].tolist() == [0, 1, 0, 2, 2, 3] and tensors["layer.9"][:, 0].tolist()[:2] == [100, 101]
    assert tensors["example"].tolist() == [40, 40, 41, 41, 41, 42]
    assert tensors["position"].tolist() == [0, 10, 0, 20, 20, 30] and tensors["token_id"].tolist()[-1] == 10
    assert all(t.is_contiguous() for t in tensors.values()) and tensors["layer.9"].dtype == torch.bfloat16
    storage = buffer.data.data_ptr()
    buffer.reset(0, [1])  # a smaller shard reuses the storage
    buffer.expect("d", 0)
    buffer.append(step([0], [("d", [0])]))
    assert buffer.data.data_ptr() == storage and buffer.tensors([4, 9])["layer.9"].tolist() == [[100.0] * 3]


def test_buffer_refuses_rows_it_cannot_place():
    buffer = ShardBuffer(2, 3, torch.float32)
    buffer.reset(0, [1, 2])
    buffer.expect("a", 0)
    buffer.expect("b", 1)
    with pytest.raises(RuntimeError, match="request 'z'"):
        buffer.append(step([0], [("z", [0])]))
    with pytest.raises(RuntimeError, match="example 0 got more than its 1"):
        buffer.append(step([0, 1], [("a", [0, 1])]))
    buffer.append(step([0], [("b", [0])]))
    with pytest.raises(RuntimeError, match="example 0 got 0 of its 1"):
        buffer.check_complete()
