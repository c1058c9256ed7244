"""``LLM.register_sae`` / ``list_saes`` / ``unregister_sae``: what must fit, what is reported, and
that a refused call registers nothing and the engine keeps serving."""

from __future__ import annotations

import json
import os

import pytest
import torch

from steerable import LLM, SAE, SamplingParams
from steerable.errors import InvalidRequestError


def random_sae(d_in: int = 64, d_sae: int = 96, architecture: str = "jumprelu", layer: int = 1,
               hook: str = "post_mlp", seed: int = 0, encoder_scale: float = 0.3, **kwargs) -> SAE:
    """``encoder_scale``: the encoder's entries' size (smaller: activations of order one on
    models whose residuals are large)."""
    g = torch.Generator().manual_seed(seed)
    extra = {"threshold": torch.rand(d_sae, generator=g) * 0.3} if architecture == "jumprelu" else {}
    extra.update({"k": 8} if architecture == "topk" else {})
    return SAE(torch.randn(d_in, d_sae, generator=g) * encoder_scale, torch.randn(d_sae, generator=g) * 0.1,
               torch.randn(d_sae, d_in, generator=g) * 0.3, torch.randn(d_in, generator=g) * 0.1,
               architecture=architecture, layer=layer, hook=hook, **{**extra, **kwargs})


TL_HOOKS = {"pre_attn": "hook_resid_pre", "post_attn": "hook_resid_mid", "post_mlp": "hook_resid_post"}


def save_saelens(sae: SAE, path: str | os.PathLike) -> str:
    """``sae`` as a SAELens directory (``cfg.json`` + ``sae_weights.safetensors``), its site as
    the TransformerLens hook name: what ``SAE.load`` and ``serve --sae`` read."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if sae.architecture == "jumprelu":
        tensors["threshold"] = sae.threshold
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "sae_weights.safetensors"))
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "architecture": {"relu": "standard"}.get(sae.architecture,
                                                                                             sae.architecture),
           "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": "none",
           "metadata": {"hook_name": f"blocks.{sae.layer}.{TL_HOOKS[sae.hook]}"}}
    if sae.architecture == "topk":
        cfg["k"] = sae.k
    with open(os.path.join(path, "cfg.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dirs):
    with LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=2048) as engine:
        yield engine


def test_register_list_unregister(llm):
    llm.register_sae("res1", random_sae())
    llm.register_sae("mid0", random_sae(architecture="topk", layer=0, hook="post_attn"))
    assert llm.list_saes() == {"res1": {"layer": 1, "hook": "post_mlp", "d_sae": 96, "architecture": "jumprelu"},
                               "mid0": {"layer": 0, "hook": "post_attn", "d_sae": 96, "architecture": "topk"}}
    stored = llm.engine.saes.get("res1")
    assert stored.dtype == llm.engine.dtype and stored.device.type == "cpu"
    llm.unregister_sae("mid0")
    llm.unregister_sae("res1")
    assert llm.list_saes() == {}


def test_bad_registrations_register_nothing(llm):
    bad = [("res", random_sae(d_in=32), "sae.d_in"), ("res", random_sae(layer=3), "sae.layer"),
           ("", random_sae(), "name"), ("res", "not an sae", "sae")]
    for name, sae, field in bad:
        with pytest.raises(InvalidRequestError, match=rf"^{field}:"):
            llm.register_sae(name, sae)
    llm.register_sae("res", random_sae())
    with pytest.raises(InvalidRequestError, match="^name: an SAE named 'res' is registered already"):
        llm.register_sae("res", random_sae(seed=1))
    with pytest.raises(InvalidRequestError, match="^name: unknown SAE 'nope'"):
        llm.unregister_sae("nope")
    assert list(llm.list_saes()) == ["res"]
    llm.unregister_sae("res")
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # still serving
