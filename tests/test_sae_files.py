"""SAE files as the libraries write them (SAELens' ``save_model``, sparsify's ``save_to_disk``, a
Gemma Scope ``params.npz``): ``SAE.load`` reads each, and ``sae.encode`` equals the library's own
encode and the reference math; bad files are refused naming the file and the field."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from steerable import SAE
from steerable.errors import InvalidRequestError

D_IN, D_SAE = 64, 128


def _randomize(module, generator, threshold: bool = False) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if param.ndim == 2 else 0.2))
            if name == "threshold" and threshold:
                param.copy_(torch.rand(param.shape, generator=generator) * 0.8)


def _reference(x, W_enc, b_enc, b_dec, architecture, threshold=None, k=None, apply_b_dec=False):
    """The issue's formulas, written out again in float64 numpy."""
    x = x.double().numpy()
    pre = (x - b_dec * apply_b_dec) @ W_enc + b_enc
    if architecture == "jumprelu":
        return torch.from_numpy(np.maximum(pre * (pre > threshold), 0))
    acts = np.maximum(pre, 0)
    if architecture == "topk":
        keep = np.argsort(-acts, axis=-1, kind="stable")[:, :k]
        out = np.zeros_like(acts)
        np.put_along_axis(out, keep, np.take_along_axis(acts, keep, -1), -1)
        acts = out
    return torch.from_numpy(acts)


def _np(t):
    return t.detach().double().numpy()


@pytest.fixture(scope="module")
def sae_files(tmp_path_factory):
    """name -> (path, library encode of ``x``, reference encode of ``x``, layer, hook); plus ``x``."""
    from sae_lens import JumpReLUSAE, JumpReLUSAEConfig, StandardSAE, StandardSAEConfig, TopKSAE, TopKSAEConfig
    from sparsify import Sae, SaeConfig

    root = tmp_path_factory.mktemp("sae_files")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, D_IN, generator=g)
    out = {}
    lens = [("standard", StandardSAE, StandardSAEConfig, {}, True, "blocks.1.hook_resid_post", (1, "post_mlp")),
            ("jumprelu", JumpReLUSAE, JumpReLUSAEConfig, {}, False, "blocks.2.hook_resid_mid", (2, "post_attn")),
            ("topk", TopKSAE, TopKSAEConfig, {"k": 8, "rescale_acts_by_decoder_norm": True}, True,
             "blocks.0.hook_resid_pre", (0, "pre_attn"))]
    for arch, cls, cfg_cls, extra, apply_b_dec, hook_name, site in lens:
        cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, apply_b_dec_to_input=apply_b_dec, **extra)
        cfg.metadata.hook_name = hook_name
        lib = cls(cfg)
        _randomize(lib, g, threshold=True)
        path = root / f"saelens_{arch}"
        lib.save_model(path)
        with torch.no_grad():
            library = lib.encode(x)
        threshold = _np(lib.threshold) if arch == "jumprelu" else None
        W_enc, b_enc = _np(lib.W_enc), _np(lib.b_enc)
        if arch == "topk":  # pre is multiplied by the decoder row norms
            norms = _np(lib.W_dec.norm(dim=-1))
            W_enc, b_enc = W_enc * norms, b_enc * norms
        ref = _reference(x, W_enc, b_enc, _np(lib.b_dec), arch, threshold, extra.get("k"), apply_b_dec)
        out[f"saelens_{arch}"] = (path, library, ref, *site)
    # An older SAELens release: the hook name at the top level, no metadata.
    old = root / "saelens_old"
    shutil.copytree(root / "saelens_standard", old)
    cfg = json.loads((old / "cfg.json").read_text())
    cfg["hook_name"] = cfg.pop("metadata")["hook_name"]
    (old / "cfg.json").write_text(json.dumps(cfg))
    out["saelens_old"] = (old, *out["saelens_standard"][1:])

    coder = Sae(D_IN, SaeConfig(num_latents=D_SAE, k=8))
    _randomize(coder, g)
    path = root / "sparsify" / "layers.1"
    coder.save_to_disk(path)
    with torch.no_grad():
        enc = coder.encode(x)
    library = torch.zeros(len(x), D_SAE).scatter(-1, enc.top_indices, enc.top_acts)
    ref = _reference(x, _np(coder.encoder.weight).T, _np(coder.encoder.bias), _np(coder.b_dec), "topk", k=8,
                     apply_b_dec=True)
    out["sparsify"] = (path, library, ref, 1, "post_mlp")

    params = {"W_enc": np.random.default_rng(1).normal(0, 0.3, (D_IN, D_SAE)).astype(np.float32),
              "W_dec": np.random.default_rng(2).normal(0, 0.3, (D_SAE, D_IN)).astype(np.float32),
              "b_enc": np.random.default_rng(3).normal(0, 0.2, D_SAE).astype(np.float32),
              "b_dec": np.random.default_rng(4).normal(0, 0.2, D_IN).astype(np.float32),
              "threshold": np.random.default_rng(5).uniform(0, 0.8, D_SAE).astype(np.float32)}
    path = root / "gemma-scope" / "layer_2" / "width_16k" / "average_l0_5"
    path.mkdir(parents=True)
    np.savez(path / "params.npz", **params)
    p = {k: v.astype(np.float64) for k, v in params.items()}
    ref = _reference(x, p["W_enc"], p["b_enc"], p["b_dec"], "jumprelu", p["threshold"])
    out["gemma_scope"] = (path / "params.npz", ref, ref, 2, "post_mlp")
    return out, x


NAMES = ["saelens_standard", "saelens_jumprelu", "saelens_topk", "saelens_old", "sparsify", "gemma_scope"]


@pytest.mark.parametrize("name", NAMES)
def test_load_encodes_as_the_library(sae_files, name):
    files, x = sae_files
    path, library, reference, layer, hook = files[name]
    sae = SAE.load(str(path))
    assert (sae.layer, sae.hook, sae.d_in, sae.d_sae) == (layer, hook, D_IN, D_SAE)
    acts = sae.encode(x)
    assert acts.dtype == torch.float32 and acts.shape == (len(x), D_SAE)
    assert (acts - library).abs().max() <= 1e-5
    assert (acts.double() - reference).abs().max() <= 1e-5
    active = (acts > 0).sum(-1)
    assert active.min() > 0 and active.max() < D_SAE  # effect size: features fire, not all of them
    if sae.architecture == "topk":
        assert active.max() <= sae.k


def test_decode_reconstructs_as_saelens(sae_files):
    from sae_lens import SAE as LensSAE

    files, x = sae_files
    for name in ("saelens_jumprelu", "saelens_topk"):  # topk: rescaled by the decoder norms
        lib = LensSAE.load_from_disk(str(files[name][0]))
        ours = SAE.load(str(files[name][0]))
        with torch.no_grad():
            expected = lib.decode(lib.encode(x))
        assert (ours.decode(ours.encode(x)) - expected).abs().max() <= 1e-5


def test_layer_and_hook_override_and_site_from_names(sae_files):
    files, _ = sae_files
    sae = SAE.load(str(files["saelens_standard"][0]), layer=0, hook="pre_attn")
    assert (sae.layer, sae.hook) == (0, "pre_attn")
    weights = files["saelens_standard"][0] / "sae_weights.safetensors"
    assert SAE.load(str(weights)).layer == 1  # a file inside the directory names the directory
    assert SAE.load(str(files["gemma_scope"][0].parent)).layer == 2


def test_in_memory_sae_validates_each_field():
    W_enc, b_enc, W_dec, b_dec = torch.randn(8, 16), torch.zeros(16), torch.randn(16, 8), torch.zeros(8)
    ok = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, architecture="relu", layer=1)
    sae = SAE(**ok)
    assert (sae.d_in, sae.d_sae, sae.architecture, sae.hook) == (8, 16, "relu", "post_mlp")
    assert torch.equal(sae.encode(torch.ones(8)), (torch.ones(8) @ W_enc).relu())
    bad = [({"W_dec": torch.randn(8, 16)}, "W_dec"), ({"b_enc": torch.zeros(15)}, "b_enc"),
           ({"architecture": "gated"}, "architecture"), ({"architecture": "jumprelu"}, "threshold"),
           ({"architecture": "topk"}, "k"), ({"architecture": "topk", "k": 17}, "k"), ({"layer": -1}, "layer"),
           ({"hook": "mlp_mid"}, "hook"), ({"W_enc": torch.full((8, 16), float("nan"))}, "W_enc"),
           ({"b_dec": np.zeros(8, dtype=np.int64)}, "b_dec"), ({"threshold": torch.zeros(16)}, "threshold"),
           ({"rescale_acts_by_decoder_norm": True}, "rescale_acts_by_decoder_norm")]
    for change, field in bad:
        with pytest.raises(InvalidRequestError, match=rf"^{field}:"):
            SAE(**{**ok, **change})
    with pytest.raises(InvalidRequestError, match="x:"):
        sae.encode(torch.ones(9))


def test_content_hash_follows_the_weights():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(8, 16, generator=g), torch.zeros(16), torch.randn(16, 8, generator=g), torch.zeros(8)]
    a, b = SAE(*parts, architecture="relu"), SAE(*[p.clone() for p in parts], architecture="relu")
    assert a.content_hash == b.content_hash
    assert SAE(*parts, architecture="relu", layer=2).content_hash != a.content_hash
    parts[3] = parts[3] + 1e-3
    assert SAE(*parts, architecture="relu").content_hash != a.content_hash
    assert a.to(dtype=torch.bfloat16).content_hash != a.content_hash


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_bad_files_are_refused_naming_file_and_field(sae_files, tmp_path):
    files, _ = sae_files
    lens = files["saelens_jumprelu"][0]

    truncated = _copy(lens, tmp_path, "truncated")
    weights = truncated / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: os.path.getsize(weights) // 2])
    with pytest.raises(InvalidRequestError, match=r"sae_weights\.safetensors: not a readable safetensors file"):
        SAE.load(str(truncated))

    for field in ("d_sae", "architecture", "apply_b_dec_to_input"):
        missing = _copy(lens, tmp_path, f"missing_{field}")
        cfg = json.loads((missing / "cfg.json").read_text())
        del cfg[field]
        (missing / "cfg.json").write_text(json.dumps(cfg))
        with pytest.raises(InvalidRequestError, match=rf"cfg\.json: missing field '{field}'"):
            SAE.load(str(missing))

    topk = _copy(files["saelens_topk"][0], tmp_path, "topk_without_k")
    cfg = json.loads((topk / "cfg.json").read_text())
    del cfg["k"]
    (topk / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequestError, match=r"cfg\.json: missing field 'k'"):
        SAE.load(str(topk))

    no_threshold = _copy(lens, tmp_path, "no_threshold")
    weights = no_threshold / "sae_weights.safetensors"
    tensors = load_file(str(weights))
    del tensors["threshold"]
    save_file(tensors, str(weights))
    with pytest.raises(InvalidRequestError, match=r"sae_weights\.safetensors: missing tensor 'threshold'"):
        SAE.load(str(no_threshold))

    sparse = tmp_path / "sparse_no_k" / "layers.1"
    shutil.copytree(files["sparsify"][0], sparse)
    cfg = json.loads((sparse / "cfg.json").read_text())
    del cfg["k"]
    (sparse / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidRequestError, match=r"layers\.1/cfg\.json: missing field 'k'"):
        SAE.load(str(sparse))

    normalized = _copy(lens, tmp_path, "normalized")
    cfg = json.loads((normalized / "cfg.json").read_text())
    (normalized / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "expected_average_only_in"}))
    with pytest.raises(InvalidRequestError, match=r"cfg\.json: normalize_activations 'expected_average_only_in'"):
        SAE.load(str(normalized))

    wrong = _copy(lens, tmp_path, "wrong_size")
    (wrong / "cfg.json").write_text(json.dumps({**cfg, "d_sae": D_SAE * 2}))
    with pytest.raises(InvalidRequestError, match=r"cfg\.json: d_sae is 256 but the weights"):
        SAE.load(str(wrong))

    no_hook = _copy(lens, tmp_path, "no_hook")
    (no_hook / "cfg.json").write_text(json.dumps({**cfg, "metadata": {"hook_name": "blocks.2.attn.hook_z"}}))
    with pytest.raises(InvalidRequestError, match=r"hook_name 'blocks.2.attn.hook_z' is not a residual-stream or MLP point"):
        SAE.load(str(no_hook))
    assert SAE.load(str(no_hook), layer=2, hook="post_attn").layer == 2

    pickled = tmp_path / "sae.pt"
    pickled.write_bytes(b"\x80\x04not really")
    with pytest.raises(InvalidRequestError, match=r"sae\.pt.*never unpickled"):
        SAE.load(str(pickled))
    pt_dir = tmp_path / "pt_dir"
    pt_dir.mkdir()
    (pt_dir / "weights.pt").write_bytes(b"\x80\x04")
    with pytest.raises(InvalidRequestError, match="never unpickled"):
        SAE.load(str(pt_dir))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidRequestError, match="holds no SAE files"):
        SAE.load(str(empty))
    with pytest.raises(InvalidRequestError, match="does not exist"):
        SAE.load(str(tmp_path / "nowhere"))

    npz = tmp_path / "layer_3" / "params.npz"
    npz.parent.mkdir()
    np.savez(npz, W_enc=np.zeros((4, 8), np.float32), W_dec=np.zeros((8, 4), np.float32))
    with pytest.raises(InvalidRequestError, match=r"params\.npz: missing array 'b_enc'"):
        SAE.load(str(npz))
    np.savez(npz, W_enc=np.array([object()]), allow_pickle=True)
    with pytest.raises(InvalidRequestError, match=r"params\.npz: not a plain \.npz"):
        SAE.load(str(npz))

    renamed = tmp_path / "sparse_out"
    shutil.copytree(files["sparsify"][0], renamed)
    with pytest.raises(InvalidRequestError, match="pass layer= and hook="):
        SAE.load(str(renamed))
    assert SAE.load(str(renamed), layer=0, hook="pre_attn").hook == "pre_attn"
