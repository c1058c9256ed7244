"""Random transcoders for the tests, the files each release format writes for them (Gemma Scope 2,
circuit-tracer's per-layer and cross-layer layouts; SAELens through SAELens itself), and HF-hook
edits applying a transcoder feature clamp (``hf_oracle``'s edit form)."""

from __future__ import annotations

import json
import os

import torch
import yaml
from safetensors.torch import save_file

from steerable import Transcoder
from steerable.selection import SelectSpec

D = 64  # the tiny models' hidden size
WIDTH = 48  # features per layer


def random_transcoder(layers: int = 1, layer: int = 1, architecture: str = "jumprelu", skip: bool = False,
                      cross_layer: bool = False, hook: str = "mlp_in", seed: int = 0, k: int | None = None,
                      width: int = WIDTH, d: int = D) -> Transcoder:
    """``layers`` sources from ``layer`` on (one: a per-layer transcoder; several: a set, or with
    ``cross_layer`` a CLT decoding to every later layer)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    lead = () if layers == 1 else (layers,)
    decoders = rnd(width, d) if layers == 1 else [rnd(width, layers - s if cross_layer else 1, d)
                                                  for s in range(layers)]
    threshold = torch.rand(*lead, width, generator=g) * 0.2 if architecture == "jumprelu" else None
    return Transcoder(rnd(*lead, d, width, scale=0.5), rnd(*lead, width, scale=0.1), decoders,
                      rnd(*lead, d, scale=0.1), architecture, threshold=threshold,
                      k=k if architecture == "topk" else None, W_skip=rnd(*lead, d, d, scale=0.1) if skip else None,
                      layer=layer, hook=hook)


# ---------------------------------------------------------------- release layouts


def write_gemma_scope_2(tc: Transcoder, path: str) -> str:
    """``params.safetensors`` + ``config.json`` as google/gemma-scope-2-* ship a transcoder."""
    os.makedirs(path, exist_ok=True)
    tensors = {"w_enc": tc.W_enc[0], "w_dec": tc.W_dec[0][:, 0], "b_enc": tc.b_enc[0], "b_dec": tc.b_dec[0],
               "threshold": tc.threshold[0]}
    if tc.W_skip is not None:
        tensors["affine_skip_connection"] = tc.W_skip[0]  # stored [d_in, d_out]
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "params.safetensors"))
    layer = tc.layer
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"hf_hook_point_in": f"model.layers.{layer}.pre_feedforward_layernorm.output",
                   "hf_hook_point_out": f"model.layers.{layer}.post_feedforward_layernorm.output",
                   "width": tc.d_transcoder, "model_name": "google/gemma-3-270m", "architecture": "jump_relu",
                   "l0": 20, "affine_connection": tc.W_skip is not None, "type": "transcoder"}, f)
    return path


def write_circuit_tracer_set(tc: Transcoder, path: str, input_hook: str = "mlp.hook_in") -> str:
    """circuit-tracer's ``transcoder_set``: ``config.yaml`` and ``layer_i.safetensors`` as
    ``SingleLayerTranscoder.to_safetensors`` writes them (encoder [d_tc, d_model], skip [d_out, d_in])."""
    os.makedirs(path, exist_ok=True)
    for s, layer in enumerate(tc.layers):
        tensors = {"W_enc": tc.W_enc[s].T, "W_dec": tc.W_dec[s][:, 0], "b_enc": tc.b_enc[s], "b_dec": tc.b_dec[s]}
        if tc.threshold is not None:
            tensors["activation_function.threshold"] = tc.threshold[s]
        if tc.W_skip is not None:
            tensors["W_skip"] = tc.W_skip[s].T
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, f"layer_{layer}.safetensors"))
    config = {"model_name": "tiny", "model_kind": "transcoder_set", "feature_input_hook": input_hook,
              "feature_output_hook": "mlp.hook_out", "scan": "tiny-transcoders"}
    if tc.architecture == "relu":
        config["activation"] = "relu"
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    return path


def write_circuit_tracer_clt(tc: Transcoder, path: str, input_hook: str = "hook_resid_mid") -> str:
    """circuit-tracer's ``cross_layer_transcoder``: ``config.yaml`` and, per layer,
    ``W_enc_i.safetensors`` / ``W_dec_i.safetensors`` as ``CrossLayerTranscoder.to_safetensors`` writes them."""
    os.makedirs(path, exist_ok=True)
    for i in range(tc.n_sources):
        enc = {f"W_enc_{i}": tc.W_enc[i].T, f"b_enc_{i}": tc.b_enc[i], f"b_dec_{i}": tc.b_dec[i]}
        if tc.threshold is not None:
            enc[f"threshold_{i}"] = tc.threshold[i]
        save_file({k: v.contiguous() for k, v in enc.items()}, os.path.join(path, f"W_enc_{i}.safetensors"))
        save_file({f"W_dec_{i}": tc.W_dec[i].contiguous()}, os.path.join(path, f"W_dec_{i}.safetensors"))
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump({"model_name": "tiny", "model_kind": "cross_layer_transcoder", "feature_input_hook": input_hook,
                        "feature_output_hook": "hook_mlp_out"}, f)
    return path


def write_saelens(tc: Transcoder, path: str, input_hook: str = "ln2.hook_normalized"):
    """The directory SAELens' own ``save_model`` writes for this (one-layer) transcoder; returns
    (path, the SAELens module)."""
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.transcoder import (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig, JumpReLUTranscoder,
                                          JumpReLUTranscoderConfig, SkipTranscoder, SkipTranscoderConfig, Transcoder
                                          as LensTranscoder, TranscoderConfig)
    jump, skip = tc.architecture == "jumprelu", tc.W_skip is not None
    cls, cfg_cls = {(False, False): (LensTranscoder, TranscoderConfig), (False, True): (SkipTranscoder, SkipTranscoderConfig),
                    (True, False): (JumpReLUTranscoder, JumpReLUTranscoderConfig),
                    (True, True): (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig)}[(jump, skip)]
    metadata = SAEMetadata(hook_name=f"blocks.{tc.layer}.{input_hook}", hook_name_out=f"blocks.{tc.layer}.hook_mlp_out")
    module = cls(cfg_cls(d_in=tc.d_in, d_sae=tc.d_transcoder, d_out=tc.d_out, apply_b_dec_to_input=False,
                         metadata=metadata))
    with torch.no_grad():
        module.W_enc.copy_(tc.W_enc[0])
        module.b_enc.copy_(tc.b_enc[0])
        module.W_dec.copy_(tc.W_dec[0][:, 0])
        module.b_dec.copy_(tc.b_dec[0])
        if jump:
            module.threshold.copy_(tc.threshold[0])
        if skip:
            module.W_skip.copy_(tc.W_skip[0].T)
    module.save_model(path)
    return path, module


# ---------------------------------------------------------------- the oracle's edits


def activation(tc: Transcoder, index: int, x: torch.Tensor) -> torch.Tensor:
    """Feature ``index``'s activation on rows ``x`` read at its source layer, as a clamp reads it
    (a top-k transcoder's relu'd pre-activation, not asked whether it is among the top k)."""
    layer, f = tc.locate(index)
    s = layer - tc.layer
    pre = x.float() @ tc.W_enc[s, :, f].float() + tc.b_enc[s, f].float()
    if tc.architecture == "jumprelu":
        return pre.relu() * (pre > tc.threshold[s, f].float())
    return pre.relu()


def feature_clamp_edits(tc: Transcoder, index: int, value: float, strength: float = 1.0,
                        select: SelectSpec | None = None) -> list[tuple]:
    """``FeatureClamp`` of a transcoder feature as HF-hook edits: read its activation where the
    transcoder reads at the source layer, write ``strength * (value - a) * W_dec`` at ``mlp_out`` of
    each layer it decodes to."""
    layer, _ = tc.locate(index)
    state: dict[str, torch.Tensor] = {}

    def read(h: torch.Tensor) -> torch.Tensor:
        state["c"] = strength * (value - activation(tc, index, h))
        return h

    edits = [(tc.hook, layer, read, select)]
    for target, row in tc.decoder_rows(index):
        edits.append(("mlp_out", target, lambda h, row=row: h + state["c"].unsqueeze(-1) * row, select))
    return edits
