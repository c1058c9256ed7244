"""Transcoder files as the releases ship them, read without unpickling anything; the format is told
from the files, and every error is an ``InvalidRequestError`` naming the file and the field.

- Gemma Scope 2: a directory with ``params.safetensors`` (``w_enc [d_in, d_tc]``, ``w_dec [d_tc,
  d_out]``, ``b_enc``, ``b_dec``, ``threshold``, ``affine_skip_connection [d_in, d_out]`` when
  ``affine_connection``) and ``config.json`` (``type: transcoder``, ``architecture: jump_relu``,
  ``hf_hook_point_in`` / ``hf_hook_point_out`` naming the layer).
- circuit-tracer, per-layer transcoders: ``config.yaml`` (``model_kind: transcoder_set``,
  ``feature_input_hook``, ``feature_output_hook``, ``activation``, ``k``, ``transcoders``) and
  ``layer_i.safetensors`` (``W_enc [d_tc, d_model]``, ``W_dec [d_tc, d_model]``, ``b_enc``, ``b_dec``,
  ``W_skip [d_model, d_model]`` applied as ``x @ W_skip.T``, ``activation_function.threshold``, ``k``).
- circuit-tracer, cross-layer transcoders: ``config.yaml`` (``model_kind: cross_layer_transcoder``)
  and per layer ``W_enc_i.safetensors`` (``W_enc_i [d_tc, d_model]``, ``b_enc_i``, ``b_dec_i``,
  ``threshold_i``) and ``W_dec_i.safetensors`` (``W_dec_i [d_tc, n_layers - i, d_model]``).
- SAELens: ``cfg.json`` (``architecture``: ``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder``
  or ``jumprelu_skip_transcoder``; ``metadata.hook_name`` / ``hook_name_out``) and
  ``sae_weights.safetensors`` (``W_skip [d_out, d_in]`` applied as ``x @ W_skip.T``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from steerable.errors import InvalidRequestError
from steerable.hook_points import MLP_IN, POST_ATTN
from steerable.sae.files import SAELENS_WEIGHTS, _pickle_refused, _read_config, _read_safetensors, _require, load_sae
from steerable.sae.model import SAE
from steerable.sae.transcoder import Transcoder

GEMMA_SCOPE_2_PARAMS = "params.safetensors"
CIRCUIT_TRACER_CONFIG = "config.yaml"
SAELENS_TRANSCODERS = {"transcoder": "relu", "skip_transcoder": "relu", "jumprelu_transcoder": "jumprelu",
                       "jumprelu_skip_transcoder": "jumprelu"}
_LAYER_FILE = re.compile(r"^layer_(\d+)\.safetensors$")
# TransformerLens names (without "blocks.L.") of the points a transcoder reads and writes.
_INPUT_HOOKS = {"ln2.hook_normalized": MLP_IN, "hook_mlp_in": MLP_IN, "mlp.hook_in": MLP_IN,
                "hook_resid_mid": POST_ATTN}
_OUTPUT_HOOKS = ("hook_mlp_out", "mlp.hook_out")
_TL_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_POINT = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_INPUTS = {"pre_feedforward_layernorm.output": MLP_IN, "mlp.input": MLP_IN}
_HF_OUTPUTS = ("post_feedforward_layernorm.output", "mlp.output")


def looks_like_transcoder(path: str | Path) -> bool:
    """Whether ``path`` holds transcoder files (so a caller that takes either kind of dictionary
    loads it with ``load_transcoder`` rather than as an SAE)."""
    path = Path(path)
    if path.is_file():
        if _LAYER_FILE.match(path.name) or path.name in (CIRCUIT_TRACER_CONFIG, GEMMA_SCOPE_2_PARAMS):
            return True
        path = path.parent
    if not path.is_dir():
        return False
    if (path / CIRCUIT_TRACER_CONFIG).is_file() or (path / GEMMA_SCOPE_2_PARAMS).is_file():
        return True
    cfg = path / "cfg.json"
    if cfg.is_file() and (path / SAELENS_WEIGHTS).is_file():
        try:
            return _read_config(cfg).get("architecture") in SAELENS_TRANSCODERS
        except InvalidRequestError:
            return False
    return False


def load_dictionary(path: str | Path, layer: int | None = None, hook: str | None = None) -> SAE | Transcoder:
    """An SAE or a transcoder, whichever the files at ``path`` hold (what a server or the command
    line registers by path). A transcoder reads where its files say: it takes no ``hook``."""
    if looks_like_transcoder(path):
        if hook is not None:
            raise InvalidRequestError(f"hook: {str(path)!r} holds a transcoder, which reads where its files say; "
                                      "give no hook")
        return load_transcoder(path, layer)
    return load_sae(path, layer, hook)


def load_transcoder(path: str | Path, layer: int | None = None) -> Transcoder:
    """The transcoder at ``path`` (a directory, or a file in one). ``layer`` picks one layer's
    transcoder of a circuit-tracer set (default: the whole set), or sets the layer where the files
    do not say it."""
    path = Path(path)
    if not path.exists():
        raise InvalidRequestError(f"path: {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix in (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt"):
            raise _pickle_refused(path)
        match = _LAYER_FILE.match(path.name)
        if match is not None:  # one file of a circuit-tracer set
            return _load_circuit_tracer_set(path.parent, int(match.group(1)) if layer is None else layer,
                                            files={int(match.group(1)): path})
        if path.suffix not in (".safetensors", ".json", ".yaml"):
            raise InvalidRequestError(f"path: {str(path)!r} is not a transcoder file")
        path = path.parent
    if (path / CIRCUIT_TRACER_CONFIG).is_file():
        return _load_circuit_tracer(path, layer)
    if (path / GEMMA_SCOPE_2_PARAMS).is_file():
        return _load_gemma_scope_2(path, layer)
    if (path / "cfg.json").is_file() and (path / SAELENS_WEIGHTS).is_file():
        return _load_saelens(path, layer)
    raise InvalidRequestError(
        f"path: {str(path)!r} holds no transcoder files (expected {GEMMA_SCOPE_2_PARAMS} + config.json "
        f"(Gemma Scope 2), {CIRCUIT_TRACER_CONFIG} with layer_i.safetensors or W_enc_i/W_dec_i.safetensors "
        f"(circuit-tracer), or cfg.json + {SAELENS_WEIGHTS} with a transcoder architecture (SAELens))")


# ---------------------------------------------------------------- Gemma Scope 2

def _load_gemma_scope_2(path: Path, layer: int | None) -> Transcoder:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise InvalidRequestError(f"{path}: {GEMMA_SCOPE_2_PARAMS} without config.json (Gemma Scope 2 ships both)")
    cfg = _read_config(cfg_file)
    _require(cfg, ("architecture", "hf_hook_point_in", "hf_hook_point_out"), cfg_file)
    if cfg.get("type", "transcoder") != "transcoder":
        raise InvalidRequestError(f"{cfg_file}: type {cfg['type']!r} is not a transcoder (load it as an SAE)")
    if cfg["architecture"] != "jump_relu":
        raise InvalidRequestError(f"{cfg_file}: architecture {cfg['architecture']!r} is not supported "
                                  "(Gemma Scope 2 transcoders are 'jump_relu')")
    in_layer, hook = _hf_point(cfg["hf_hook_point_in"], _HF_INPUTS, cfg_file, "hf_hook_point_in")
    out_layer, _ = _hf_point(cfg["hf_hook_point_out"], dict.fromkeys(_HF_OUTPUTS), cfg_file, "hf_hook_point_out")
    if out_layer != in_layer:
        raise InvalidRequestError(f"{cfg_file}: hf_hook_point_out is at layer {out_layer}, hf_hook_point_in at "
                                  f"{in_layer}; a per-layer transcoder writes the MLP output of the layer it reads")
    params_file = path / GEMMA_SCOPE_2_PARAMS
    tensors = _read_safetensors(params_file)
    return _gemma_scope_2_layer(tensors, params_file, cfg_file, in_layer if layer is None else layer, hook,
                                skip=cfg.get("affine_connection"))


def _gemma_scope_2_layer(tensors: dict[str, torch.Tensor], params_file: Path, where_cfg: Path, layer: int,
                         hook: str, skip: bool | None = None) -> Transcoder:
    """One layer in Gemma Scope 2's tensor names (also what circuit-tracer's configs point at)."""
    _require(tensors, ("w_enc", "w_dec", "b_enc", "b_dec", "threshold"), params_file, "tensor")
    has_skip = "affine_skip_connection" in tensors
    if skip is not None and bool(skip) != has_skip:
        raise InvalidRequestError(f"{where_cfg}: affine_connection is {skip!r} but {params_file.name} "
                                  f"{'has' if has_skip else 'has no'} affine_skip_connection")
    return _build(params_file, W_enc=tensors["w_enc"], b_enc=tensors["b_enc"], W_dec=tensors["w_dec"],
                  b_dec=tensors["b_dec"], architecture="jumprelu", threshold=tensors["threshold"],
                  W_skip=tensors.get("affine_skip_connection"), layer=layer, hook=hook)


def _hf_point(name: Any, known: dict[str, Any], where: Path, field: str) -> tuple[int, Any]:
    match = _HF_POINT.match(name) if isinstance(name, str) else None
    if match is None or match.group(2) not in known:
        raise InvalidRequestError(f"{where}: {field} {name!r} is not a point a transcoder reads or writes "
                                  f"(expected 'model.layers.L.' + one of {sorted(known)})")
    return int(match.group(1)), known[match.group(2)]


# ---------------------------------------------------------------- circuit-tracer

def _load_circuit_tracer(path: Path, layer: int | None) -> Transcoder:
    cfg_file = path / CIRCUIT_TRACER_CONFIG
    cfg = _read_config(cfg_file)
    _require(cfg, ("model_kind",), cfg_file)
    kind = cfg["model_kind"]
    if kind == "transcoder_set":
        return _load_circuit_tracer_set(path, layer, cfg=cfg)
    if kind == "cross_layer_transcoder":
        if layer is not None:
            raise InvalidRequestError(f"layer: a cross-layer transcoder ({cfg_file}) loads whole, at every layer")
        return _load_circuit_tracer_clt(path, cfg)
    raise InvalidRequestError(f"{cfg_file}: model_kind {kind!r} is not supported; expected 'transcoder_set' or "
                              "'cross_layer_transcoder'")


def _circuit_tracer_hooks(cfg: dict[str, Any], cfg_file: Path | None) -> str:
    """The point the encoders read, from ``feature_input_hook`` (the MLP's input when there is no config)."""
    if cfg_file is None:
        return MLP_IN
    _require(cfg, ("feature_input_hook", "feature_output_hook"), cfg_file)
    hook_in, hook_out = cfg["feature_input_hook"], cfg["feature_output_hook"]
    if hook_in not in _INPUT_HOOKS:
        raise InvalidRequestError(f"{cfg_file}: feature_input_hook {hook_in!r} is not supported; expected one of "
                                  f"{sorted(_INPUT_HOOKS)}")
    if hook_out not in _OUTPUT_HOOKS:
        raise InvalidRequestError(f"{cfg_file}: feature_output_hook {hook_out!r} is not supported; expected one of "
                                  f"{list(_OUTPUT_HOOKS)}")
    return _INPUT_HOOKS[hook_in]


def _load_circuit_tracer_set(path: Path, layer: int | None, cfg: dict[str, Any] | None = None,
                             files: dict[int, Path] | None = None) -> Transcoder:
    """A set of per-layer transcoders (all of them, or the one at ``layer``) as one ``Transcoder``."""
    cfg_file = path / CIRCUIT_TRACER_CONFIG
    if cfg is None:
        cfg = _read_config(cfg_file) if cfg_file.is_file() else {}
    where = cfg_file if cfg else None
    hook = _circuit_tracer_hooks(cfg, where)
    files = files if files is not None else _set_files(path, cfg, cfg_file)
    if layer is not None:
        if layer not in files:
            raise InvalidRequestError(f"layer: {path} has no transcoder for layer {layer!r}; it has "
                                      f"{sorted(files)}")
        files = {layer: files[layer]}
    layers = sorted(files)
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise InvalidRequestError(f"{path}: layer files {layers} are not consecutive")
    activation, k = cfg.get("activation"), cfg.get("k")
    parts = [_circuit_tracer_layer(files[i], i, activation, k, hook, cfg_file) for i in layers]
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for part, i in zip(parts, layers):
        if (part.architecture, part.k, part.d_transcoder, part.d_in, part.W_skip is None) != (
                first.architecture, first.k, first.d_transcoder, first.d_in, first.W_skip is None):
            raise InvalidRequestError(f"{files[i]}: its architecture, k, width or skip connection differs from "
                                      f"{files[layers[0]].name}'s; a set shares them")
    stack = {name: None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])
             for name in ("W_enc", "b_enc", "b_dec", "threshold", "W_skip")}
    return Transcoder(stack["W_enc"], stack["b_enc"], [p.W_dec[0] for p in parts], stack["b_dec"],
                      first.architecture, stack["threshold"], first.k, stack["W_skip"], layers[0], hook)


def _set_files(path: Path, cfg: dict[str, Any], cfg_file: Path) -> dict[int, Path]:
    """Each layer's file: those ``transcoders`` lists (local copies of ``hf://`` entries found by
    name in ``path``), else every ``layer_i.safetensors`` in ``path``."""
    listed = cfg.get("transcoders")
    if listed is None:
        files = {int(m.group(1)): p for p in path.iterdir() if (m := _LAYER_FILE.match(p.name))}
        if not files:
            raise InvalidRequestError(f"{path}: no layer_i.safetensors files beside {cfg_file.name}")
        return files
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise InvalidRequestError(f"{cfg_file}: transcoders must be a list of paths")
    files = {}
    for i, entry in enumerate(listed):
        name = entry.rsplit("/", 1)[-1]
        candidates = [path / name] if entry.startswith("hf://") else [path / entry, path / name]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise InvalidRequestError(f"{cfg_file}: transcoders[{i}] {entry!r} is not a local file (download the "
                                      f"set first; looked for {name} in {path})")
        files[i] = found
    return files


def _circuit_tracer_layer(file: Path, layer: int, activation: Any, k: Any, hook: str, cfg_file: Path) -> Transcoder:
    tensors = _read_safetensors(file)
    if "w_enc" in tensors:  # a Gemma Scope 2 params file the config points at
        return _gemma_scope_2_layer(tensors, file, cfg_file, layer, hook)
    _require(tensors, ("W_enc", "W_dec", "b_enc", "b_dec"), file, "tensor")
    threshold = tensors.get("activation_function.threshold")
    if activation == "topk":
        if k is None and "k" in tensors:
            k = int(tensors["k"].reshape(-1)[0])
        if k is None:
            raise InvalidRequestError(f"{cfg_file}: activation 'topk' needs k (in config.yaml or a 'k' tensor)")
        architecture = "topk"
        threshold = None
    elif activation in (None, "jump_relu", "jumprelu"):
        architecture = "jumprelu" if threshold is not None else "relu"
        k = None
    elif activation == "relu":
        architecture, threshold, k = "relu", None, None
    else:
        raise InvalidRequestError(f"{cfg_file}: activation {activation!r} is not supported; expected 'relu', "
                                  "'topk' or none (JumpReLU from the files' thresholds)")
    skip = tensors.get("W_skip")
    return _build(file, W_enc=_transposed(tensors["W_enc"], file, "W_enc"), b_enc=tensors["b_enc"],
                  W_dec=tensors["W_dec"], b_dec=tensors["b_dec"], architecture=architecture, threshold=threshold,
                  k=k, W_skip=None if skip is None else _transposed(skip, file, "W_skip"), layer=layer, hook=hook)


def _load_circuit_tracer_clt(path: Path, cfg: dict[str, Any]) -> Transcoder:
    cfg_file = path / CIRCUIT_TRACER_CONFIG
    hook = _circuit_tracer_hooks(cfg, cfg_file)
    encoders = sorted(int(m.group(1)) for p in path.iterdir() if (m := re.fullmatch(r"W_enc_(\d+)\.safetensors",
                                                                                     p.name)))
    if not encoders or encoders != list(range(len(encoders))):
        raise InvalidRequestError(f"{path}: expected W_enc_0.safetensors .. W_enc_(n-1).safetensors beside "
                                  f"{cfg_file.name}, found layers {encoders}")
    n = len(encoders)
    enc, dec = [], []
    for i in range(n):
        enc_file, dec_file = path / f"W_enc_{i}.safetensors", path / f"W_dec_{i}.safetensors"
        tensors = _read_safetensors(enc_file)
        names = [f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}"]
        _require(tensors, names, enc_file, "tensor")
        enc.append((tensors[names[0]], tensors[names[1]], tensors[names[2]], tensors.get(f"threshold_{i}")))
        if not dec_file.is_file():
            raise InvalidRequestError(f"{dec_file}: missing (every layer has its decoders to the later layers)")
        decoders = _read_safetensors(dec_file)
        _require(decoders, (f"W_dec_{i}",), dec_file, "tensor")
        dec.append(decoders[f"W_dec_{i}"])
    thresholds = [t for *_, t in enc]
    if any(t is None for t in thresholds) and not all(t is None for t in thresholds):
        raise InvalidRequestError(f"{path}: threshold_i is in some W_enc_i files but not all")
    jumprelu = thresholds[0] is not None
    first = path / "W_enc_0.safetensors"
    return _build(first, W_enc=torch.stack([_transposed(w, path / f"W_enc_{i}.safetensors", f"W_enc_{i}")
                                            for i, (w, *_) in enumerate(enc)]),
                  b_enc=torch.stack([b for _, b, _, _ in enc]), W_dec=dec, b_dec=torch.stack([b for _, _, b, _ in enc]),
                  architecture="jumprelu" if jumprelu else "relu",
                  threshold=torch.stack(thresholds) if jumprelu else None, layer=0, hook=hook)


# ---------------------------------------------------------------- SAELens

def _load_saelens(path: Path, layer: int | None) -> Transcoder:
    cfg_file = path / "cfg.json"
    cfg = _read_config(cfg_file)
    _require(cfg, ("architecture", "d_in", "d_sae"), cfg_file)
    architecture = cfg["architecture"]
    if architecture not in SAELENS_TRANSCODERS:
        raise InvalidRequestError(f"{cfg_file}: architecture {architecture!r} is not a transcoder; expected one of "
                                  f"{sorted(SAELENS_TRANSCODERS)} (an SAE loads with SAE.load)")
    for key in ("normalize_activations", "reshape_activations"):
        if cfg.get(key, "none") not in ("none", None):
            raise InvalidRequestError(f"{cfg_file}: {key} {cfg[key]!r} is not supported (only 'none')")
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook_name = metadata.get("hook_name") or cfg.get("hook_name")
    hook_out = metadata.get("hook_name_out") or cfg.get("hook_name_out")
    in_layer, hook = _tl_point(hook_name, _INPUT_HOOKS, cfg_file, "hook_name", layer)
    if hook_out is not None:
        out_layer, _ = _tl_point(hook_out, dict.fromkeys(_OUTPUT_HOOKS), cfg_file, "hook_name_out", layer)
        if out_layer != in_layer:
            raise InvalidRequestError(f"{cfg_file}: hook_name_out is at layer {out_layer}, hook_name at {in_layer}")
    weights_file = path / SAELENS_WEIGHTS
    tensors = _read_safetensors(weights_file)
    jumprelu = SAELENS_TRANSCODERS[architecture] == "jumprelu"
    skip = "skip" in architecture
    _require(tensors, ["W_enc", "b_enc", "W_dec", "b_dec"] + ["threshold"] * jumprelu + ["W_skip"] * skip,
             weights_file, "tensor")
    transcoder = _build(weights_file, W_enc=tensors["W_enc"], b_enc=tensors["b_enc"], W_dec=tensors["W_dec"],
                        b_dec=tensors["b_dec"], architecture=SAELENS_TRANSCODERS[architecture],
                        threshold=tensors["threshold"] if jumprelu else None,
                        W_skip=_transposed(tensors["W_skip"], weights_file, "W_skip") if skip else None,
                        layer=in_layer if layer is None else layer, hook=hook)
    for name, stated, actual in (("d_in", cfg["d_in"], transcoder.d_in), ("d_sae", cfg["d_sae"], transcoder.d_sae),
                                 ("d_out", cfg.get("d_out"), transcoder.d_out)):
        if stated is not None and stated != actual:
            raise InvalidRequestError(f"{cfg_file}: {name} is {stated!r} but the weights in {weights_file.name} "
                                      f"have {actual}")
    return transcoder


def _tl_point(name: Any, known: dict[str, Any], where: Path, field: str, layer: int | None) -> tuple[int, Any]:
    """(layer, point) of a TransformerLens hook name ``blocks.L.<known>``; ``layer`` overrides L."""
    match = _TL_NAME.match(name) if isinstance(name, str) else None
    if match is None or match.group(2) not in known:
        said = f"{field} {name!r}" if name else f"no {field}"
        raise InvalidRequestError(f"{where}: {said} is not a point a transcoder reads or writes (expected "
                                  f"'blocks.L.' + one of {sorted(known)})")
    return (int(match.group(1)) if layer is None else layer), known[match.group(2)]


# ---------------------------------------------------------------- shared

def _transposed(tensor: torch.Tensor, where: Path, name: str) -> torch.Tensor:
    if tensor.ndim != 2:
        raise InvalidRequestError(f"{where}: tensor {name!r} must be 2-D, got shape {list(tensor.shape)}")
    return tensor.T.contiguous()


def _build(weights_file: Path, **kwargs: Any) -> Transcoder:
    """``Transcoder(**kwargs)``; its errors name the file."""
    try:
        return Transcoder(**kwargs)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"{weights_file}: {err}") from None
