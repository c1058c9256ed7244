"""pyreft's trained LoReFT interventions as a ``SteeringSpec``: its saved directory (``config.json``
of the pyvene ``IntervenableConfig``, one ``intkey_<key>.bin`` or ``.safetensors`` of weights per
intervention) read without pyreft, the weights with ``torch.load(weights_only=True)`` or safetensors,
so a file holding pickled objects is refused, never run.

LoReFT's ``h + R^T (W h + b - R h)`` is saved as ``rotate_layer`` [d, r] (``R^T``), ``weight``
[r, d] (``W``) and ``bias`` [r] (``b``); each becomes one ``LowRank`` at its layer's point
(``block_output`` is ``post_mlp``, ``block_input`` ``pre_attn``), on the positions pyreft's
position spec names.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from typing import Any

import torch

from steerable.hook_points import POST_MLP, PRE_ATTN
from steerable.selection import SelectSpec
from steerable.steering.items import LowRank
from steerable.steering.spec import SteeringSpec

COMPONENTS = {"block_output": POST_MLP, "block_input": PRE_ATTN}
_LAYER_OUTPUT = re.compile(r"model\.layers\[(\d+)\]\.output")
_POSITIONS = re.compile(r"(?:f(\d+))?\+?(?:l(\d+))?")
# pyvene's RepresentationConfig fields, in the order a saved list holds them.
_FIELDS = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension")


def load_reft(path: str, positions: str | None = None, share_weights: bool = True) -> SteeringSpec:
    """The LoReFT interventions pyreft saved in ``path`` (``ReftModel.save``) as one ``LowRank``
    each. ``positions``: pyreft's position spec, ``"f<N>+l<M>"`` (the first N and last M prompt
    tokens), ``"f<N>"`` or ``"l<M>"``; None: every token. ``share_weights=False`` is pyreft's layout
    for ``"f<N>+l<M>"`` without shared weights: the first half of the interventions acts on the first
    positions, the second half on the last ones. ``ValueError`` names the file and field at fault."""
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path}: not a pyreft save ({err})") from None
    representations, kinds, keys = (config.get(field) for field in ("representations", "intervention_types",
                                                                    "sorted_keys"))
    if not (isinstance(representations, list) and isinstance(kinds, list) and isinstance(keys, list)
            and len(representations) == len(kinds) == len(keys) and keys):
        raise ValueError(f"{config_path}: expected equally long lists 'representations', 'intervention_types' and "
                         "'sorted_keys'")
    selects = _selects(positions, len(keys), share_weights)
    items = []
    for i, (representation, kind, key) in enumerate(zip(representations, kinds, keys)):
        where = f"{config_path}: representations[{i}]"
        if not isinstance(kind, str) or not kind.endswith("LoreftIntervention'>"):
            raise ValueError(f"{config_path}: intervention_types[{i}] is {kind!r}; only LoreftIntervention loads "
                             "(a LowRank)")
        layer, hook = _site(representation, where)
        weights = _weights(path, key)
        missing = [name for name in ("rotate_layer", "weight", "bias") if name not in weights]
        if missing:
            raise ValueError(f"{_weights_file(path, key)}: missing {missing} (LoReFT's rotate_layer, weight, bias)")
        items.append(LowRank(layer, weights["rotate_layer"].float().T.contiguous(), weights["weight"].float(),
                             weights["bias"].float(), hook, selects[i]))
    return SteeringSpec(interventions=items)


def _site(representation: Any, where: str) -> tuple[int, str]:
    if isinstance(representation, list):
        representation = dict(zip(_FIELDS, representation))
    if not isinstance(representation, dict):
        raise ValueError(f"{where}: expected a list or dict, got {type(representation).__name__}")
    layer, component = representation.get("layer"), representation.get("component", "block_output")
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"{where}.layer: expected an integer, got {layer!r}")
    if representation.get("unit", "pos") != "pos":
        raise ValueError(f"{where}.unit: {representation['unit']!r}; only 'pos' (token positions) is supported")
    match = _LAYER_OUTPUT.fullmatch(component) if isinstance(component, str) else None
    if match:
        return int(match.group(1)), POST_MLP
    if component not in COMPONENTS:
        raise ValueError(f"{where}.component: {component!r}; expected one of {sorted(COMPONENTS)} or "
                         "'model.layers[N].output'")
    return layer, COMPONENTS[component]


def _weights_file(path: str, key: str) -> str:
    for suffix in (".safetensors", ".bin"):
        candidate = os.path.join(path, f"intkey_{key}{suffix}")
        if os.path.exists(candidate):
            return candidate
    raise ValueError(f"{os.path.join(path, f'intkey_{key}.bin')}: no weights for intervention {key!r}")


def _weights(path: str, key: str) -> dict[str, torch.Tensor]:
    """The intervention's tensors; a file that holds anything but tensors is a ``ValueError``."""
    file = _weights_file(path, key)
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(f"{file}: not a file of tensors (only weights load; pickled objects are refused): "
                         f"{str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file}: expected a dict of tensors")
    return state


def _selects(positions: str | None, count: int, share_weights: bool) -> list[SelectSpec | None]:
    """Each intervention's rows for pyreft's position spec."""
    if positions is None:
        return [None] * count
    match = _POSITIONS.fullmatch(positions) if isinstance(positions, str) else None
    if not match or not any(match.groups()):
        raise ValueError(f"positions: expected pyreft's 'f<N>+l<M>', 'f<N>' or 'l<M>', got {positions!r}")
    first, last = (int(n) if n else 0 for n in match.groups())
    head = list(range(first))
    tail = list(range(-last, 0))
    if not head and not tail:
        raise ValueError(f"positions: {positions!r} names no position")
    if share_weights or not head or not tail:
        return [SelectSpec(prompt_positions=head + tail)] * count
    if count % 2:
        raise ValueError(f"share_weights=False splits the interventions between the first and last positions; "
                         f"there are {count}, an odd number")
    return [SelectSpec(prompt_positions=head)] * (count // 2) + [SelectSpec(prompt_positions=tail)] * (count // 2)
