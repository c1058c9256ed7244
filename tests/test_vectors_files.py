"""ControlVector arithmetic and files: llama.cpp/repeng GGUF interop and safetensors, exact round
trips, and bad files failing with a message that names what is wrong."""

import gguf
import numpy as np
import pytest
import torch

from steerable import SteeringSpec
from steerable.errors import InvalidRequestError
from steerable.vectors import ControlVector

WIDTH = 64


def make_cv(layers=(1, 2, 5), seed=0, **metadata) -> ControlVector:
    g = torch.Generator().manual_seed(seed)
    return ControlVector({layer: torch.randn(WIDTH, generator=g) for layer in layers}, metadata=metadata)


def write_repeng(path, directions: dict[int, np.ndarray], layer_count_type="uint32", hint="llama") -> None:
    """A control vector exactly as repeng's ``export_gguf`` writes one (llama.cpp writes i32)."""
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", hint)
    getattr(writer, f"add_{layer_count_type}")("controlvector.layer_count", len(directions))
    for layer, vector in directions.items():
        writer.add_tensor(f"direction.{layer}", vector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("layer_count_type", ["uint32", "int32"])
def test_repeng_file_loads_with_its_layer_mapping(tmp_path, layer_count_type):
    rng = np.random.default_rng(0)
    directions = {n: rng.standard_normal(WIDTH).astype(np.float32) for n in (1, 3, 7)}
    write_repeng(tmp_path / "r.gguf", directions, layer_count_type)
    cv = ControlVector.load(tmp_path / "r.gguf")
    assert cv.hook == "post_mlp" and cv.layers == [1, 3, 7]  # direction.N -> post_mlp of layer N
    for n, vector in directions.items():
        assert np.array_equal(cv.directions[n].numpy(), vector)
    assert cv.metadata["model_hint"] == "llama"


def test_export_has_exactly_the_control_vector_keys_and_tensors(tmp_path):
    cv = make_cv(model_hint="llama", method="mean_diff", residual_norm={1: 3.0, 2: 4.0, 5: 5.0})
    cv.save(tmp_path / "out.gguf")
    reader = gguf.GGUFReader(tmp_path / "out.gguf")
    keys = {name for name in reader.fields if not name.startswith("GGUF.")}
    assert keys == {"general.architecture", "controlvector.model_hint", "controlvector.layer_count"}
    assert reader.fields["general.architecture"].contents() == "controlvector"
    assert reader.fields["controlvector.model_hint"].contents() == "llama"
    assert reader.fields["controlvector.layer_count"].contents() == 3
    assert reader.fields["controlvector.layer_count"].types == [gguf.GGUFValueType.UINT32]
    assert [t.name for t in reader.tensors] == ["direction.1", "direction.2", "direction.5"]
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [WIDTH]
        assert np.array_equal(t.data, cv.directions[int(t.name.split(".")[1])].numpy())


def test_round_trips_are_exact(tmp_path):
    cv = make_cv(model_hint="qwen3", method="pca_diff", layers_note="x", residual_norm={1: 1 / 3, 2: 2.5, 5: 1e-7})
    cv.save(tmp_path / "v.gguf")
    back = ControlVector.load(tmp_path / "v.gguf")
    assert back.layers == cv.layers and back.hook == cv.hook
    assert all(torch.equal(back.directions[n], cv.directions[n]) for n in cv.layers)
    assert back.metadata["model_hint"] == "qwen3"
    pre = ControlVector(cv.directions, "pre_attn", cv.metadata)
    pre.save(tmp_path / "v.safetensors")
    back = ControlVector.load(tmp_path / "v.safetensors")
    assert back.hook == "pre_attn" and back.metadata == pre.metadata
    assert all(torch.equal(back.directions[n], cv.directions[n]) for n in cv.layers)


def test_what_gguf_cannot_hold(tmp_path):
    with pytest.raises(InvalidRequestError, match="hook.*post_attn"):
        ControlVector(make_cv().directions, "post_attn").save(tmp_path / "a.gguf")
    with pytest.raises(InvalidRequestError, match="direction.0"):
        make_cv(layers=(0, 1)).save(tmp_path / "b.gguf")
    with pytest.raises(InvalidRequestError, match="path"):
        make_cv().save(tmp_path / "c.npy")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_bad_files_name_the_problem(tmp_path):
    rng = np.random.default_rng(1)
    write_repeng(tmp_path / "wide.gguf", {1: rng.standard_normal(WIDTH).astype(np.float32),
                                          2: rng.standard_normal(WIDTH + 1).astype(np.float32)})
    with pytest.raises(InvalidRequestError, match="wide.gguf.*same width"):
        ControlVector.load(tmp_path / "wide.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(InvalidRequestError, match="general.architecture is 'llama'"):
        ControlVector.load(tmp_path / "model.gguf")
    write_repeng(tmp_path / "half.gguf", {1: np.zeros(WIDTH, np.float16)})
    with pytest.raises(InvalidRequestError, match="direction.1.*F32"):
        ControlVector.load(tmp_path / "half.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(InvalidRequestError, match="junk.gguf"):
        ControlVector.load(tmp_path / "junk.gguf")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        ControlVector.load(tmp_path / "missing.gguf")


def test_width_and_layers_checked_against_a_model(tmp_path):
    write_repeng(tmp_path / "v.gguf", {1: np.ones(WIDTH, np.float32), 40: np.ones(WIDTH, np.float32)})
    cv = ControlVector.load(tmp_path / "v.gguf")
    with pytest.raises(InvalidRequestError, match=r"v.gguf: layers \[40\] do not exist .* 30 layers"):
        cv.check_model(WIDTH, 30, str(tmp_path / "v.gguf"))
    with pytest.raises(InvalidRequestError, match="width 64 does not match the model's hidden size 576"):
        cv.check_model(576, 60)


def test_arithmetic():
    a, b = make_cv((1, 2), seed=1), make_cv((2, 3), seed=2)
    assert torch.equal((-a).directions[1], -a.directions[1])
    assert torch.equal((a * 1.5).directions[2], a.directions[2] * 1.5)
    assert torch.equal((2 * a).directions[2], (a / 0.5).directions[2])
    total = a + b
    assert total.layers == [1, 2, 3]
    assert torch.equal(total.directions[2], a.directions[2] + b.directions[2])
    assert torch.equal(total.directions[1], a.directions[1]) and torch.equal(total.directions[3], b.directions[3])
    assert torch.allclose((a - a).directions[1], torch.zeros(WIDTH))
    assert total.in_layer_range(2, 3).layers == [2, 3]
    with pytest.raises(InvalidRequestError, match="hook"):
        a + ControlVector(b.directions, "pre_attn")
    with pytest.raises(InvalidRequestError, match="scale"):
        a * float("nan")
    with pytest.raises(InvalidRequestError, match="layer_range"):
        a.in_layer_range(7, 9)


def test_to_spec_absolute_and_relative():
    cv = make_cv((1, 2), residual_norm={1: 10.0, 2: 40.0})
    spec = cv.to_spec(2.0)
    assert isinstance(spec, SteeringSpec) and [i.layer for i in spec.interventions] == [1, 2]
    assert all(i.hook == "post_mlp" and i.select is None for i in spec.interventions)
    assert torch.equal(spec.interventions[0].vector, cv.directions[1] * 2.0)
    relative = cv.to_spec(0.25, relative=True)
    assert [float(i.vector.norm()) for i in relative.interventions] == pytest.approx([2.5, 10.0], rel=1e-6)
    assert torch.allclose(relative.interventions[1].vector / 10.0, cv.directions[2] / cv.directions[2].norm())
    with pytest.raises(InvalidRequestError, match="relative"):
        make_cv((1,)).to_spec(1.0, relative=True)


@pytest.mark.parametrize("directions, match", [
    ({}, "non-empty"),
    ({-1: torch.ones(4)}, "layer -1"),
    ({1: torch.ones(2, 2)}, "1-D"),
    ({1: torch.tensor([1.0, float("inf")])}, "NaN or Inf"),
])
def test_bad_vectors(directions, match):
    with pytest.raises(InvalidRequestError, match=match):
        ControlVector(directions)
