"""The pieces of corpus capture below the engine: the safetensors writer (the bytes ``save_file``
writes, read back by ``safe_open``)."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from steerable.capture import shard_file
from steerable.capture.shard_file import write_safetensors


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
    monkeypatch.setattr(shard_file, "SLICE_BYTES", 40)  # every tensor in several slices, written by several threads
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
