"""``Transcoder.load`` reads every release layout, written here in its real form (Gemma Scope 2,
circuit-tracer's per-layer and cross-layer files, SAELens through SAELens itself), into the same
math as the transcoder written; bad files and bad in-memory weights are a ``ValueError`` naming the
file and the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transcoder_helpers import (random_transcoder, write_circuit_tracer_clt, write_circuit_tracer_set,
                                write_gemma_scope_2, write_saelens)

from steerable import SAE, Transcoder
from steerable.errors import InvalidRequestError
from steerable.sae.transcoder_files import looks_like_transcoder

X = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))


def assert_same_math(loaded: Transcoder, written: Transcoder) -> None:
    assert (loaded.layers, loaded.hook, loaded.architecture, loaded.kind) == (
        written.layers, written.hook, written.architecture, written.kind)
    inputs = [X * (1 + s) for s in range(written.n_sources)]
    for s, layer in enumerate(written.layers):
        assert torch.equal(loaded.encode(inputs[s], layer), written.encode(inputs[s], layer))
    for ours, ref in zip(loaded.reconstruct(inputs), written.reconstruct(inputs)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert loaded.content_hash == written.content_hash
    assert any((written.encode(x, layer) > 0).any() for x, layer in zip(inputs, written.layers))


def test_gemma_scope_2(tmp_path):
    tc = random_transcoder(layer=2, skip=True, seed=1)
    path = write_gemma_scope_2(tc, str(tmp_path / "transcoder_all" / "layer_2_width_16k_l0_small_affine"))
    assert looks_like_transcoder(path) and looks_like_transcoder(os.path.join(path, "params.safetensors"))
    assert_same_math(Transcoder.load(path), tc)
    assert_same_math(Transcoder.load(os.path.join(path, "params.safetensors")), tc)
    assert Transcoder.load(path, layer=0).layer == 0  # layer= overrides what the files say
    plain = random_transcoder(layer=1, seed=2)
    assert Transcoder.load(write_gemma_scope_2(plain, str(tmp_path / "plain"))).W_skip is None


def test_circuit_tracer_per_layer_set_and_one_layer(tmp_path):
    tc = random_transcoder(layers=3, layer=0, architecture="relu", skip=True, seed=3)
    path = write_circuit_tracer_set(tc, str(tmp_path / "set"))
    loaded = Transcoder.load(path)
    assert loaded.kind == "transcoder_set" and loaded.d_sae == 3 * loaded.d_transcoder
    assert_same_math(loaded, tc)
    one = Transcoder.load(path, layer=1)
    assert one.layers == (1,) and torch.equal(one.W_enc[0], tc.W_enc[1]) and torch.equal(one.W_skip[0], tc.W_skip[1])
    assert Transcoder.load(os.path.join(path, "layer_2.safetensors")).layers == (2,)
    jump = random_transcoder(layers=2, layer=0, seed=4)
    assert_same_math(Transcoder.load(write_circuit_tracer_set(jump, str(tmp_path / "jump"), "ln2.hook_normalized")), jump)
    # A set whose config lists hf:// files finds local copies by name.
    cfg = yaml.safe_load(open(os.path.join(path, "config.yaml")))
    cfg["transcoders"] = [f"hf://org/repo/layer_{i}.safetensors" for i in range(3)]
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    assert_same_math(Transcoder.load(path), tc)


def test_circuit_tracer_topk_reads_k(tmp_path):
    tc = random_transcoder(layer=0, architecture="topk", k=5, seed=5)
    path = write_circuit_tracer_set(tc, str(tmp_path / "topk"))
    with open(os.path.join(path, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump({**cfg, "activation": "topk", "k": 5}, f)
    loaded = Transcoder.load(path)
    assert loaded.architecture == "topk" and loaded.k == 5
    assert ((loaded.encode(X) > 0).sum(-1) <= 5).all() and torch.equal(loaded.encode(X), tc.encode(X))


def test_circuit_tracer_cross_layer(tmp_path):
    tc = random_transcoder(layers=3, layer=0, cross_layer=True, hook="post_attn", seed=6)
    path = write_circuit_tracer_clt(tc, str(tmp_path / "clt"))
    loaded = Transcoder.load(path)
    assert loaded.kind == "cross_layer_transcoder" and loaded.spans == (3, 2, 1)
    assert_same_math(loaded, tc)
    relu = random_transcoder(layers=2, layer=0, architecture="relu", cross_layer=True, hook="mlp_in", seed=7)
    assert_same_math(Transcoder.load(write_circuit_tracer_clt(relu, str(tmp_path / "relu"), "ln2.hook_normalized")),
                     relu)


@pytest.mark.parametrize("architecture,skip", [("jumprelu", True), ("jumprelu", False), ("relu", True),
                                               ("relu", False)])
def test_saelens_transcoders_equal_saelens_forward(tmp_path, architecture, skip):
    tc = random_transcoder(layer=1, architecture=architecture, skip=skip, seed=8)
    path, module = write_saelens(tc, str(tmp_path / "lens"))
    loaded = Transcoder.load(path)
    assert_same_math(loaded, tc)
    with torch.no_grad():  # SAELens' own forward: features and output (skip term included)
        torch.testing.assert_close(loaded.encode(X), module.encode(X), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded.reconstruct([X])[0], module(X), atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="is a transcoder; load it with steerable.Transcoder.load"):
        SAE.load(path)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_files_name_the_file_and_field(tmp_path):
    tc = random_transcoder(layer=1, skip=True, seed=10)
    gs = write_gemma_scope_2(tc, str(tmp_path / "gs"))
    cfg = json.load(open(os.path.join(gs, "config.json")))

    def gs_variant(name: str, config: dict | None = None, drop: str | None = None) -> str:
        path = _copy(gs, tmp_path / name)
        if config is not None:
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(config, f)
        if drop is not None:
            tensors = load_file(os.path.join(path, "params.safetensors"))
            del tensors[drop]
            save_file(tensors, os.path.join(path, "params.safetensors"))
        return path

    cases = [
        (gs_variant("no_threshold", drop="threshold"), r"gs_no_threshold|no_threshold/params\.safetensors: missing tensor 'threshold'"),
        (gs_variant("sae_type", {**cfg, "type": "sae"}), r"config\.json: type 'sae' is not a transcoder"),
        (gs_variant("arch", {**cfg, "architecture": "topk"}), r"config\.json: architecture 'topk' is not supported"),
        (gs_variant("hook", {**cfg, "hf_hook_point_in": "model.layers.1.output"}),
         r"config\.json: hf_hook_point_in 'model\.layers\.1\.output' is not a point"),
        (gs_variant("skip", {**cfg, "affine_connection": False}), r"config\.json: affine_connection is False"),
        (gs_variant("layers", {**cfg, "hf_hook_point_out": "model.layers.2.post_feedforward_layernorm.output"}),
         r"hf_hook_point_out is at layer 2"),
    ]
    set_path = write_circuit_tracer_set(random_transcoder(layers=2, layer=0, seed=11), str(tmp_path / "set"))
    for name, change in [("kind", {"model_kind": "crosscoder"}), ("hook_in", {"feature_input_hook": "hook_resid_pre"}),
                         ("hook_out", {"feature_output_hook": "hook_resid_post"}), ("act", {"activation": "gelu"}),
                         ("topk", {"activation": "topk"}), ("listed", {"transcoders": ["/nowhere/layer_0.safetensors",
                                                                                       "hf://x/y/missing.safetensors"]})]:
        path = _copy(set_path, tmp_path / f"set_{name}")
        cfg_set = yaml.safe_load(open(os.path.join(path, "config.yaml")))
        with open(os.path.join(path, "config.yaml"), "w") as f:
            yaml.safe_dump({**cfg_set, **change}, f)
        cases.append((path, {"kind": r"model_kind 'crosscoder' is not supported",
                             "hook_in": r"feature_input_hook 'hook_resid_pre' is not supported",
                             "hook_out": r"feature_output_hook 'hook_resid_post' is not supported",
                             "act": r"activation 'gelu' is not supported", "topk": r"activation 'topk' needs k",
                             "listed": r"config\.yaml: transcoders\[1\] 'hf://x/y/missing.safetensors' is not a local file"
                             }[name]))
    gap = _copy(set_path, tmp_path / "set_gap")
    os.rename(os.path.join(gap, "layer_1.safetensors"), os.path.join(gap, "layer_3.safetensors"))
    cases.append((gap, r"layer files \[0, 3\] are not consecutive"))
    clt = write_circuit_tracer_clt(random_transcoder(layers=3, layer=0, cross_layer=True, seed=12), str(tmp_path / "clt"))
    no_dec = _copy(clt, tmp_path / "clt_no_dec")
    os.remove(os.path.join(no_dec, "W_dec_1.safetensors"))
    cases.append((no_dec, r"W_dec_1\.safetensors: missing"))
    wide = _copy(clt, tmp_path / "clt_wide")
    save_file({"W_dec_2": torch.zeros(48, 2, 64)}, os.path.join(wide, "W_dec_2.safetensors"))
    cases.append((wide, r"W_enc_0\.safetensors: W_dec\[2\]: expected shape \[48, span in \[1, 1\], 64\]"))
    lens, _ = write_saelens(random_transcoder(layer=1, seed=13), str(tmp_path / "lens"))
    lens_cfg = json.load(open(os.path.join(lens, "cfg.json")))
    for name, change, pattern in [("lens_hook", {"metadata": {"hook_name": "blocks.1.hook_resid_post"}},
                                   r"cfg\.json: hook_name 'blocks\.1\.hook_resid_post' is not a point"),
                                  ("lens_size", {"d_sae": 96}, r"cfg\.json: d_sae is 96 but the weights"),
                                  ("lens_norm", {"normalize_activations": "layer_norm"}, r"normalize_activations")]:
        path = _copy(lens, tmp_path / name)
        with open(os.path.join(path, "cfg.json"), "w") as f:
            json.dump({**lens_cfg, **change}, f)
        cases.append((path, pattern))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases += [(str(empty), "holds no transcoder files"), (str(tmp_path / "nowhere"), "path: .* does not exist")]
    pickled = tmp_path / "tc.pt"
    pickled.write_bytes(b"\x80\x04not really")
    cases.append((str(pickled), "never unpickled"))
    for path, pattern in cases:
        with pytest.raises(InvalidRequestError, match=pattern):
            Transcoder.load(path)
    with pytest.raises(InvalidRequestError, match=r"^layer: .* has no transcoder for layer 5"):
        Transcoder.load(set_path, layer=5)
    with pytest.raises(InvalidRequestError, match=r"^layer: a cross-layer transcoder .* loads whole"):
        Transcoder.load(clt, layer=0)


def test_in_memory_transcoder_validates_each_field():
    good = dict(W_enc=torch.randn(8, 16), b_enc=torch.zeros(16), W_dec=torch.randn(16, 8), b_dec=torch.zeros(8),
                architecture="relu")
    Transcoder(**good)
    bad = [({"W_dec": torch.randn(15, 8)}, "W_dec"), ({"b_enc": torch.zeros(15)}, "b_enc"),
           ({"b_dec": torch.zeros(9)}, "b_dec"), ({"architecture": "gated"}, "architecture"),
           ({"architecture": "jumprelu"}, "threshold"), ({"architecture": "topk", "k": 0}, "k"),
           ({"threshold": torch.zeros(16)}, "threshold"), ({"W_skip": torch.zeros(8, 9)}, "W_skip"),
           ({"layer": -1}, "layer"), ({"hook": "post_mlp"}, "hook"),
           ({"W_enc": torch.full((8, 16), float("nan"))}, "W_enc"),
           ({"W_enc": torch.randn(2, 8, 16), "b_enc": torch.zeros(2, 16), "b_dec": torch.zeros(2, 8)}, "W_dec"),
           ({"W_enc": torch.randn(2, 8, 16), "b_enc": torch.zeros(2, 16), "b_dec": torch.zeros(2, 8),
             "W_dec": [torch.randn(16, 2, 8), torch.randn(16, 2, 8)]}, r"W_dec\[1\]")]
    for change, field in bad:
        with pytest.raises(InvalidRequestError, match=rf"^{field}:"):
            Transcoder(**{**good, **change})
    tc = random_transcoder(layers=2, layer=0, cross_layer=True)
    with pytest.raises(InvalidRequestError, match=r"^layer: this transcoder reads at layers \[0, 1\]"):
        tc.encode(X)
    with pytest.raises(InvalidRequestError, match=r"^x: expected a last dimension of 64"):
        tc.encode(X[:, :8], 0)
