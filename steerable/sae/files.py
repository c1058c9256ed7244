"""SAE files as the releases ship them, read without unpickling anything: a SAELens directory
(``cfg.json`` + ``sae_weights.safetensors``), an EleutherAI sparsify directory (``cfg.json`` +
``sae.safetensors``) and a Gemma Scope ``params.npz``. The format is told from the files; every
error is an ``InvalidRequestError`` naming the file and the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from steerable.errors import InvalidRequestError
from steerable.hook_points import MLP_IN, MLP_OUT, POST_ATTN, POST_MLP, PRE_ATTN
from steerable.sae.model import SAE

SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
GEMMA_SCOPE_PARAMS = "params.npz"
_PICKLE_SUFFIXES = {".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt"}
# TransformerLens names of the points an SAE may read: resid_pre L enters block L, resid_mid follows
# its attention, resid_post leaves it; the MLP's normalised input and its output.
_TL_HOOK = re.compile(r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_mid|hook_resid_post|ln2\.hook_normalized|"
                      r"hook_mlp_in|hook_mlp_out)$")
_TL_POINTS = {"hook_resid_pre": PRE_ATTN, "hook_resid_mid": POST_ATTN, "hook_resid_post": POST_MLP,
              "ln2.hook_normalized": MLP_IN, "hook_mlp_in": MLP_IN, "hook_mlp_out": MLP_OUT}
_SAELENS_ARCHITECTURES = {"standard", "jumprelu", "topk"}


def load_sae(path: str | Path, layer: int | None = None, hook: str | None = None) -> SAE:
    """The SAE at ``path`` (a directory, or a file in one); ``layer``/``hook`` override what the
    files say and are required where they say nothing."""
    path = Path(path)
    if not path.exists():
        raise InvalidRequestError(f"path: {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix in _PICKLE_SUFFIXES:
            raise _pickle_refused(path)
        if path.name == GEMMA_SCOPE_PARAMS or path.suffix == ".npz":
            return _load_gemma_scope(path, layer, hook)
        if path.suffix in (".safetensors", ".json"):
            path = path.parent
        else:
            raise InvalidRequestError(f"path: {str(path)!r} is not an SAE file (expected a SAELens or sparsify "
                                      f"directory or a Gemma Scope {GEMMA_SCOPE_PARAMS})")
    if (path / "cfg.json").is_file() and (path / SAELENS_WEIGHTS).is_file():
        return _load_saelens(path, layer, hook)
    if (path / "cfg.json").is_file() and (path / SPARSIFY_WEIGHTS).is_file():
        return _load_sparsify(path, layer, hook)
    if (path / GEMMA_SCOPE_PARAMS).is_file():
        return _load_gemma_scope(path / GEMMA_SCOPE_PARAMS, layer, hook)
    pickles = sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_refused(pickles[0])
    raise InvalidRequestError(f"path: {str(path)!r} holds no SAE files (expected cfg.json with {SAELENS_WEIGHTS} "
                              f"(SAELens) or {SPARSIFY_WEIGHTS} (sparsify), or {GEMMA_SCOPE_PARAMS} (Gemma Scope); "
                              "transcoders load with steerable.Transcoder.load)")


def _pickle_refused(path: Path) -> InvalidRequestError:
    return InvalidRequestError(f"path: {str(path)!r} is a pickle (PyTorch .pt) file; SAE files are never unpickled, "
                               "since loading one can run arbitrary code. Convert it to safetensors "
                               "(a SAELens or sparsify directory) first")


# ---------------------------------------------------------------- SAELens

def _load_saelens(path: Path, layer: int | None, hook: str | None) -> SAE:
    cfg_file = path / "cfg.json"
    cfg = _read_config(cfg_file)
    _require(cfg, ("d_in", "d_sae", "architecture", "apply_b_dec_to_input"), cfg_file)
    architecture = cfg["architecture"]
    if isinstance(architecture, str) and architecture.endswith("transcoder"):
        raise InvalidRequestError(f"{cfg_file}: architecture {architecture!r} is a transcoder; load it with "
                                  "steerable.Transcoder.load")
    if architecture not in _SAELENS_ARCHITECTURES:
        raise InvalidRequestError(f"{cfg_file}: architecture {architecture!r} is not supported; expected one of "
                                  f"{sorted(_SAELENS_ARCHITECTURES)}")
    for key in ("normalize_activations", "reshape_activations"):
        value = cfg.get(key, "none")
        if value not in ("none", None):
            raise InvalidRequestError(f"{cfg_file}: {key} {value!r} is not supported (only 'none'): the SAE would "
                                      "read a rescaled input the engine does not compute")
    if architecture == "topk":
        _require(cfg, ("k",), cfg_file)
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook_name = metadata.get("hook_name") or cfg.get("hook_name")
    layer, hook = _site(hook_name, layer, hook, cfg_file)
    weights_file = path / SAELENS_WEIGHTS
    tensors = _read_safetensors(weights_file)
    if architecture == "jumprelu" and "threshold" not in tensors and "log_threshold" in tensors:
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold").float())  # older training checkpoints
    names = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if architecture == "jumprelu" else [])
    _require(tensors, names, weights_file, "tensor")
    return _build(weights_file, d_in=cfg["d_in"], d_sae=cfg["d_sae"], where_cfg=cfg_file,
                  W_enc=tensors["W_enc"], b_enc=tensors["b_enc"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"],
                  architecture=architecture, threshold=tensors.get("threshold") if architecture == "jumprelu" else None,
                  k=cfg["k"] if architecture == "topk" else None,
                  apply_b_dec_to_input=cfg["apply_b_dec_to_input"], layer=layer, hook=hook,
                  rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False))
                  if architecture == "topk" else False)


# ---------------------------------------------------------------- EleutherAI sparsify

def _load_sparsify(path: Path, layer: int | None, hook: str | None) -> SAE:
    cfg_file = path / "cfg.json"
    cfg = _read_config(cfg_file)
    _require(cfg, ("d_in", "k"), cfg_file)
    if cfg.get("activation", "topk") != "topk":
        raise InvalidRequestError(f"{cfg_file}: activation {cfg['activation']!r} is not supported (only 'topk')")
    for key in ("transcode", "skip_connection"):
        if cfg.get(key):
            raise InvalidRequestError(f"{cfg_file}: {key}=true is not supported: the coder does not reconstruct "
                                      "the residual stream it reads")
    d_in = cfg["d_in"]
    d_sae = cfg.get("num_latents") or 0
    if not d_sae:
        if "expansion_factor" not in cfg:
            raise InvalidRequestError(f"{cfg_file}: missing 'num_latents' (or 'expansion_factor')")
        d_sae = d_in * cfg["expansion_factor"] if isinstance(d_in, int) else None
    match = re.fullmatch(r"layers\.(\d+)", path.name)
    if (layer is None or hook is None) and match is None:
        raise InvalidRequestError(f"{path}: the directory name does not say the layer (sparsify names it "
                                  "'layers.L'); pass layer= and hook=")
    layer = int(match.group(1)) if layer is None else layer
    hook = POST_MLP if hook is None else hook  # 'layers.L' is the output of block L
    weights_file = path / SPARSIFY_WEIGHTS
    tensors = _read_safetensors(weights_file)
    _require(tensors, ("encoder.weight", "encoder.bias", "W_dec", "b_dec"), weights_file, "tensor")
    encoder = tensors["encoder.weight"]
    return _build(weights_file, d_in=d_in, d_sae=d_sae, where_cfg=cfg_file, W_enc=encoder.T.contiguous(),
                  b_enc=tensors["encoder.bias"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"], architecture="topk",
                  k=cfg["k"], apply_b_dec_to_input=True, layer=layer, hook=hook)


# ---------------------------------------------------------------- Gemma Scope

def _load_gemma_scope(path: Path, layer: int | None, hook: str | None) -> SAE:
    if layer is None:
        found = [int(m.group(1)) for part in path.parts if (m := re.fullmatch(r"layer_(\d+)", part))]
        if not found:
            raise InvalidRequestError(f"{path}: Gemma Scope files do not say their layer (the release's folders "
                                      "are named 'layer_L'); pass layer=")
        layer = found[-1]
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except ValueError as err:  # object arrays need pickle: refused
        raise InvalidRequestError(f"{path}: not a plain .npz of arrays ({err})") from None
    except Exception as err:  # a truncated or corrupt archive
        raise InvalidRequestError(f"{path}: not a readable .npz file ({type(err).__name__}: {err})") from None
    _require(arrays, ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"), path, "array")
    W_enc = arrays["W_enc"]
    return _build(path, d_in=W_enc.shape[0] if W_enc.ndim == 2 else None, d_sae=None, where_cfg=path,
                  W_enc=W_enc, b_enc=arrays["b_enc"], W_dec=arrays["W_dec"], b_dec=arrays["b_dec"],
                  architecture="jumprelu", threshold=arrays["threshold"], apply_b_dec_to_input=False,
                  layer=layer, hook=POST_MLP if hook is None else hook)


# ---------------------------------------------------------------- shared

def _site(hook_name: Any, layer: int | None, hook: str | None, where: Path) -> tuple[int, str]:
    """Layer and hook from a TransformerLens hook name, unless the caller gave both."""
    if layer is not None and hook is not None:
        return layer, hook
    match = _TL_HOOK.match(hook_name) if isinstance(hook_name, str) else None
    if match is None:
        said = f"hook_name {hook_name!r} is not a residual-stream or MLP point" if hook_name else "no hook_name"
        raise InvalidRequestError(f"{where}: {said} (expected 'blocks.L.hook_resid_pre|mid|post', "
                                  "'blocks.L.ln2.hook_normalized' or 'blocks.L.hook_mlp_out'); pass layer= and hook=")
    return (int(match.group(1)) if layer is None else layer), (_TL_POINTS[match.group(2)] if hook is None else hook)


def _build(weights_file: Path, d_in: Any, d_sae: Any, where_cfg: Path, **kwargs: Any) -> SAE:
    """``SAE(**kwargs)`` checked against the sizes the config states; errors name the file."""
    try:
        sae = SAE(**kwargs)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"{weights_file}: {err}") from None
    for name, stated, actual in (("d_in", d_in, sae.d_in), ("d_sae", d_sae, sae.d_sae)):
        if stated is not None and stated != actual:
            raise InvalidRequestError(f"{where_cfg}: {name} is {stated!r} but the weights in {weights_file.name} "
                                      f"have {actual}")
    return sae


def _read_config(path: Path) -> dict[str, Any]:
    """A JSON file holding an object (a ``.yaml`` one: a YAML mapping), or an error naming it."""
    if path.suffix == ".yaml":
        import yaml  # only circuit-tracer's configs are YAML

        parse, errors, kind = yaml.safe_load, (yaml.YAMLError,), "YAML"
    else:
        parse, errors, kind = json.loads, (json.JSONDecodeError,), "JSON"
    try:
        data = parse(path.read_text())
    except (OSError, UnicodeDecodeError, *errors) as err:
        raise InvalidRequestError(f"{path}: not a readable {kind} file ({err})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{path}: expected a {kind} {'mapping' if kind == 'YAML' else 'object'}, got "
                                  f"{type(data).__name__}")
    return data


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error type for a truncated or corrupt file
        raise InvalidRequestError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def _require(data: dict, keys: Any, where: Path, kind: str = "field") -> None:
    missing = [key for key in keys if key not in data]
    if missing:
        raise InvalidRequestError(f"{where}: missing {kind} {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:]
                                                                               else ""))
