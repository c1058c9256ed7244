"""Ray Data batches in and out: rows to prompts and ``SamplingParams``, outputs to columns.

A batch comes as Ray hands it to ``map_batches`` (``{column: numpy array}``, a pandas DataFrame or
a pyarrow Table). Nested columns arrive as Arrow turns JSON into them: a struct gets every key
any row has (``None`` where a row lacks it), lists become numpy arrays and a nullable integer may
become a float; rows are turned back into the JSON the server's body fields take (``None`` keys
dropped, arrays to lists, whole floats to ints where an integer is expected) and parsed by the
server's own parsers. A nested column may also be a JSON string, which is the way to give rows of
different shapes (Arrow cannot hold a string in one row and a dict in the next).

Output columns hold numpy arrays: a row's captures as ``[rows, width]`` arrays (bfloat16 as float32:
numpy has no bfloat16) with their labels, each key its own column, so the dataset writes to
Parquet as it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from steerable.capture.patterns import AttentionPatterns
from steerable.capture.sparse import SparseFeatures
from steerable.entrypoints.openai.extensions import capture_from_json, module_ref_from_json
from steerable.errors import InvalidRequestError
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams
from steerable.steering.wire import steering_from_json

PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")
_PLANE_FIELDS = ("steering_vectors", "steering_module_ref", "capture")
# Keys of the steering and capture JSON whose values are integers (Arrow may hand them as floats).
_INT_KEYS = {"layer", "layers", "index", "top_k", "budget_rows", "heads", "prompt_positions", "generation_positions",
             "positions", "prompt_tokens", "generation_tokens", "prompt_window", "generation_window"}


# ---------------------------------------------------------------- batches

def batch_columns(batch: Any) -> dict[str, np.ndarray]:
    """``{column: array}`` of a batch in any of Ray's batch formats."""
    if hasattr(batch, "to_pydict") and hasattr(batch, "schema"):  # pyarrow.Table
        return {name: objects(values) for name, values in batch.to_pydict().items()}
    if hasattr(batch, "columns") and hasattr(batch, "to_numpy"):  # pandas.DataFrame
        return {str(name): batch[name].to_numpy() for name in batch.columns}
    if isinstance(batch, Mapping):
        return {str(name): np.asarray(values) if not isinstance(values, np.ndarray) else values
                for name, values in batch.items()}
    raise TypeError(f"expected a Ray Data batch (dict of arrays, pandas DataFrame or pyarrow Table), "
                    f"got {type(batch).__name__}")


def num_rows(columns: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def objects(values: Sequence[Any]) -> np.ndarray:
    """A column of one Python object or array per row (a ragged column of arrays stays one)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def missing(value: Any) -> bool:
    """No value in this row: None, or the NaN pandas puts in an empty cell."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def plain(value: Any, where: str, ints: bool = False) -> Any:
    """A cell as the JSON it was: numpy to Python, ``None`` keys dropped; ``ints``: whole floats
    to ints (the value sits under a key that holds integers)."""
    if isinstance(value, np.ndarray):
        return [plain(v, where, ints) for v in value.tolist()] if value.dtype != object else \
            [plain(v, where, ints) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v, f"{where}.{k}", ints or k in _INT_KEYS) for k, v in value.items() if not missing(v)}
    if isinstance(value, (list, tuple)):
        return [plain(v, where, ints) for v in value]
    if ints and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def carried(column: np.ndarray) -> np.ndarray:
    """An input column as an output column: nested cells back to Python (Ray hands them over as
    numpy arrays inside objects, which Arrow would only store pickled)."""
    return column if column.dtype != object else objects([_python(value) for value in column])


def _python(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist() if value.dtype != object else [_python(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_python(v) for v in value]
    return value


def json_cell(value: Any, where: str) -> Any:
    """A nested cell: Arrow's form of the JSON, or the JSON itself as a string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"{where}: not valid JSON ({err.msg})") from None
    return plain(value, where)


# ---------------------------------------------------------------- rows in

def row_prompt(columns: Mapping[str, np.ndarray], i: int, tokenizer: Any) -> str | list[int]:
    """Row i's prompt: ``prompt`` (text), ``messages`` (a chat, through the chat template) or
    ``prompt_token_ids``, exactly one of them."""
    given = [name for name in PROMPT_COLUMNS if name in columns and not _empty(columns[name][i])]
    if len(given) != 1:
        said = f"both {given[0]!r} and {given[1]!r}" if given else "none of them"
        raise InvalidRequestError(f"row {i}: give one of {list(PROMPT_COLUMNS)}, got {said}")
    name, value = given[0], columns[given[0]][i]
    if name == "prompt":
        if not isinstance(value, str):
            raise InvalidRequestError(f"row {i}: prompt: expected a string, got {type(value).__name__}")
        return value
    if name == "messages":
        messages = json_cell(value, f"row {i}: messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError(f"row {i}: messages: expected a list of {{'role', 'content'}} dicts")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = plain(value, f"row {i}: prompt_token_ids", ints=True)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError(f"row {i}: prompt_token_ids: expected a list of integers")
    return ids


def row_params(columns: Mapping[str, np.ndarray], i: int, defaults: Mapping[str, Any],
               capture_default: Any) -> SamplingParams:
    """Row i's ``SamplingParams``: ``defaults`` updated by its ``sampling_params``, with its
    ``steering`` (the server's ``steering_vectors``), ``steering_module_ref`` and ``capture``
    (``capture_default`` where the row has none) parsed as the server parses them."""
    where = f"row {i}: sampling_params"
    own = _cell(columns, "sampling_params", i)
    own = json_cell(own, where) if own is not None else {}
    if not isinstance(own, dict):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(own).__name__}")
    fields = {**defaults, **own}
    for name in _PLANE_FIELDS:
        if name in fields:
            column = "steering" if name == "steering_vectors" else name
            raise InvalidRequestError(f"{where}.{name}: give it as the row's {column!r} column")
    fields = {k: _as_int(v) if k in _INT_FIELDS else v for k, v in fields.items()}
    if fields.get("n", 1) != 1:
        raise InvalidRequestError(f"{where}.n: one completion per row (give a row per completion, e.g. with "
                                  "different seeds)")
    steering = _cell(columns, "steering", i)
    module_ref = _cell(columns, "steering_module_ref", i)
    capture = _cell(columns, "capture", i)
    try:
        return SamplingParams(
            **fields,
            steering_vectors=steering_from_json(json_cell(steering, f"row {i}: steering"), f"row {i}: steering")
            if steering is not None else None,
            steering_module_ref=module_ref_from_json(json_cell(module_ref, f"row {i}: steering_module_ref"))
            if module_ref is not None else None,
            capture=capture_from_json(json_cell(capture, f"row {i}: capture") if capture is not None
                                      else capture_default))
    except TypeError as err:  # an unknown keyword
        raise InvalidRequestError(f"{where}: {err}") from None


def _cell(columns: Mapping[str, np.ndarray], name: str, i: int) -> Any:
    if name not in columns:
        return None
    value = columns[name][i]
    return None if _empty(value) else value


def _empty(value: Any) -> bool:
    return missing(value) or (isinstance(value, Mapping) and all(missing(v) for v in value.values()))


_INT_FIELDS = {name for name, kind in SamplingParams.__annotations__.items() if str(kind).startswith(("int", "list[int]"))}


def _as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (list, np.ndarray)):
        return [_as_int(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    return value


# ---------------------------------------------------------------- outputs out

def capture_arrays(out: RequestOutput) -> dict[str, np.ndarray]:
    """One output's captures as ``{column: array}``: ``STREAM.KEY`` (``[rows, width]``; attention
    patterns ``[rows, heads, keys]`` zero-padded, with ``.key_starts`` and ``.key_lens``; SAE
    features as ``.indices`` and ``.values``) and the labels ``.positions`` and ``.token_ids``."""
    arrays: dict[str, np.ndarray] = {}
    for stream, keys in out.captures.items():
        for key, value in keys.items():
            base = f"{stream}.{key}"
            meta = out.capture_meta[stream][key]
            if isinstance(value, SparseFeatures):
                arrays[f"{base}.indices"], arrays[f"{base}.values"] = value.indices.numpy(), value.values.numpy()
            elif isinstance(value, AttentionPatterns):
                arrays[base] = to_numpy(value.padded())
                arrays[f"{base}.key_starts"], arrays[f"{base}.key_lens"] = value.key_starts.numpy(), \
                    value.key_lens.numpy()
            else:
                arrays[base] = to_numpy(value)
            arrays[f"{base}.positions"], arrays[f"{base}.token_ids"] = meta.positions.numpy(), meta.token_ids.numpy()
    return arrays


def ragged_columns(per_row: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One column per key any row has; a row without it gets zero rows of the same shape (a
    column of ``None`` and arrays would not convert to a tensor column)."""
    names = list(dict.fromkeys(name for row in per_row for name in row))
    columns = {}
    for name in names:
        like = next(row[name] for row in per_row if name in row)
        empty = np.zeros((0, *like.shape[1:]), like.dtype)
        columns[name] = objects([row.get(name, empty) for row in per_row])
    return columns


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
