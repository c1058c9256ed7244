"""A corpus file as ``steerable capture --input`` takes it: JSON lines of texts (``{"text": ...}``,
the key set by ``--field``) or of pre-tokenized windows (``{"token_ids": [...]}``, used as given),
or a Hugging Face dataset directory saved with ``save_to_disk`` (a text column, or a ``token_ids``
/ ``input_ids`` / ``tokens`` column of windows, as SAELens' pretokenizer writes), read with
pyarrow alone."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from steerable.errors import InvalidRequestError
from steerable.files import read_jsonl

TOKEN_COLUMNS = ("token_ids", "input_ids", "tokens")


def read_corpus(path: str, field: str = "text") -> list[str] | np.ndarray:
    """Texts, or ``int [windows, N]`` token ids."""
    if os.path.isdir(path):
        return _read_dataset_dir(path, field)
    texts: list[str] = []
    windows: list[list[int]] = []
    for i, record in enumerate(read_jsonl(path)):
        if isinstance(record, dict) and isinstance(record.get(field), str) and record[field]:
            texts.append(record[field])
        elif isinstance(record, dict) and isinstance(record.get("token_ids"), list) and record["token_ids"]:
            windows.append(record["token_ids"])
        else:
            raise InvalidRequestError(f"{path}: record {i} has neither a non-empty string field {field!r} nor a "
                                      "non-empty 'token_ids' list")
    if texts and windows:
        raise InvalidRequestError(f"{path}: mixes texts and token_ids records; use one kind")
    if not texts and not windows:
        raise InvalidRequestError(f"{path}: no texts")
    return texts if texts else _windows(windows, path)


def _windows(rows: list[Any], where: str) -> np.ndarray:
    lengths = {len(row) for row in rows}
    if len(lengths) != 1:
        raise InvalidRequestError(f"{where}: pre-tokenized windows differ in length ({sorted(lengths)[:5]})")
    try:
        return np.asarray(rows, dtype=np.int64)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{where}: token_ids must be lists of integers") from None


def _read_dataset_dir(path: str, field: str) -> list[str] | np.ndarray:
    import pyarrow as pa

    state_path = os.path.join(path, "state.json")
    if not os.path.isfile(state_path):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            raise InvalidRequestError(f"{path}: a DatasetDict; pass one split's directory (e.g. {path}/train)")
        raise InvalidRequestError(f"{path}: not a dataset saved with save_to_disk (no state.json)")
    with open(state_path, encoding="utf-8") as f:
        files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(os.path.join(path, name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    table = pa.concat_tables(tables)
    for column in TOKEN_COLUMNS:
        if column in table.column_names:
            return _token_column(table.column(column).combine_chunks(), f"{path} column {column!r}")
    if field in table.column_names:
        texts = table.column(field).to_pylist()
        if all(isinstance(t, str) for t in texts):
            return [t for t in texts if t]
    raise InvalidRequestError(f"{path}: no text column {field!r} and no token column ({', '.join(TOKEN_COLUMNS)}); "
                              f"columns: {table.column_names}")


def _token_column(column: Any, where: str) -> np.ndarray:
    """A list column of equally long token-id rows as ``int64 [rows, N]``, without Python lists."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.list_value_length(column)
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if not len(column) or shortest != longest or not shortest:
        raise InvalidRequestError(f"{where}: pre-tokenized windows must be non-empty and of one length "
                                  f"(from {shortest} to {longest})")
    values = column.flatten()
    if not pa.types.is_integer(values.type):
        raise InvalidRequestError(f"{where}: token ids must be integers, got {values.type}")
    return values.to_numpy().astype(np.int64).reshape(len(column), shortest)

