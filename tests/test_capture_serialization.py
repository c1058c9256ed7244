"""Capture wire format, request-id matching and capture consumers (CPU only)."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from steerable.capture import consumers as consumers_mod
from steerable.capture.consumers import CaptureConsumer, FilesystemConsumer, LoggingConsumer, read_capture_shard
from steerable.capture.serialization import (
    WIRE_DTYPES,
    CaptureMeta,
    deserialize_captured,
    match_capture_request_id,
    serialize_capture_layer,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
TABLE = ["req-0-0123abcd", "req-1-deadbeef", "req-10-cafef00d"]


def _layer(rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, width, generator=g) * 100).to(dtype)
    labels = torch.stack([torch.randint(0, len(TABLE), (rows,), generator=g),
                          torch.arange(rows) + 3,
                          torch.randint(0, 50000, (rows,), generator=g)], dim=1).to(torch.int32)
    if rows:
        labels[-1, 1:] = -1  # a synthesized row ('mean' reduction)
    return t, labels


def _payload(dtype=torch.bfloat16):
    t, labels = _layer(5, 8, dtype)
    return {3: serialize_capture_layer(t, labels, TABLE)}, t, labels


def _expected_meta(labels: torch.Tensor) -> CaptureMeta:
    return CaptureMeta([TABLE[i] for i in labels[:, 0].tolist()], labels[:, 1], labels[:, 2])


# ---------------------------------------------------------------- wire format round trip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_round_trip_exact(dtype, rows):
    t, labels = _layer(rows, 16, dtype, seed=rows)
    if rows:
        t[0, :2] = torch.tensor([float("nan"), float("-inf")]).to(dtype)
    wire = serialize_capture_layer(t, labels, TABLE, layout={"num_heads": 4, "head_size": 4})
    assert set(wire) == {"encoding", "dtype", "shape", "data", "meta", "layout"}
    assert wire["encoding"] == "raw" and wire["dtype"] == str(dtype) and wire["shape"] == [rows, 16]
    assert isinstance(wire["data"], bytes) and len(wire["data"]) == rows * 16 * t.element_size()
    assert set(wire["meta"]) == {"req_table", "req_idx", "positions", "token_ids"}
    assert wire["layout"] == {"num_heads": 4, "head_size": 4}
    tensors, meta = deserialize_captured({7: wire})
    out = tensors[7]
    assert out.dtype == dtype and out.shape == (rows, 16)
    # bit-exact (NaN-safe): compare the raw bits
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    assert torch.equal(out.view(bits), t.view(bits))
    assert meta[7] == _expected_meta(labels)
    assert meta[7].positions.dtype == torch.int32 and meta[7].token_ids.dtype == torch.int32
    out.add_(1)  # decoded tensors own writable memory


def test_bf16_travels_as_raw_int16_bytes():
    t = torch.tensor([[1.0, -2.5, 3.140625]], dtype=torch.bfloat16)
    wire = serialize_capture_layer(t, torch.zeros(1, 3, dtype=torch.int32), ["r"])
    assert wire["data"] == t.view(torch.int16).numpy().astype("<i2").tobytes()
    assert len(wire["data"]) == 6  # no float32 upcast
    assert "layout" not in wire


def test_multiple_layers_and_requests_string_keys():
    wire, labels_by_layer = {}, {}
    for layer, dtype in [(0, torch.bfloat16), (5, torch.float16), (11, torch.float32)]:
        t, labels = _layer(9, 4, dtype, seed=layer)
        wire[str(layer)] = serialize_capture_layer(t, labels, TABLE)  # JSON-style keys
        labels_by_layer[layer] = (t, labels)
    tensors, meta = deserialize_captured(wire)
    assert list(tensors) == [0, 5, 11] and list(meta) == [0, 5, 11]
    for layer, (t, labels) in labels_by_layer.items():
        assert torch.equal(tensors[layer], t)
        assert meta[layer] == _expected_meta(labels)
        assert len(meta[layer]) == 9
        assert set(meta[layer].req_ids) <= set(TABLE)


def test_serialize_accepts_views_and_noncontiguous():
    base = torch.randn(6, 10, dtype=torch.float32)
    t = base[1:5, ::2]
    labels = torch.zeros(4, 3, dtype=torch.int32)
    tensors, _ = deserialize_captured({0: serialize_capture_layer(t, labels, ["a"])})
    assert torch.equal(tensors[0], t)


# ---------------------------------------------------------------- rejections


@pytest.mark.parametrize("case", [
    "labels_dtype", "labels_shape", "labels_1d", "row_mismatch", "req_idx_high", "req_idx_negative",
    "dtype_int", "dtype_float8", "tensor_1d", "tensor_3d", "table_not_str",
])
def test_serialize_rejects(case):
    t, labels = _layer(4, 3, torch.float32)
    table = TABLE
    if case == "labels_dtype":
        labels = labels.long()
    elif case == "labels_shape":
        labels = labels[:, :2]
    elif case == "labels_1d":
        labels = labels[:, 0]
    elif case == "row_mismatch":
        labels = labels[:3]
    elif case == "req_idx_high":
        labels[1, 0] = len(TABLE)
    elif case == "req_idx_negative":
        labels[1, 0] = -1
    elif case == "dtype_int":
        t = t.to(torch.int32)
    elif case == "dtype_float8":
        t = t.to(torch.float8_e4m3fn)
    elif case == "tensor_1d":
        t = t[:, 0]
    elif case == "tensor_3d":
        t = t[:, :, None]
    elif case == "table_not_str":
        table = [1, 2, 3]
    with pytest.raises(ValueError):
        serialize_capture_layer(t, labels, table)


def _mutate(case: str, info: dict) -> None:
    m = info["meta"]
    if case == "encoding":
        info["encoding"] = "zstd"
    elif case == "encoding_missing":
        del info["encoding"]
    elif case == "dtype":
        info["dtype"] = "torch.int8"
    elif case == "data_short":
        info["data"] = info["data"][:-1]
    elif case == "data_long":
        info["data"] = info["data"] + b"\0\0"
    elif case == "shape_mismatch":
        info["shape"] = [info["shape"][0] + 1, info["shape"][1]]
    elif case == "shape_3d":
        info["shape"] = info["shape"] + [1]
    elif case == "meta_missing":
        del info["meta"]
    elif case == "positions_short":
        m["positions"] = m["positions"][:-4]
    elif case == "token_ids_long":
        m["token_ids"] = m["token_ids"] + b"\0\0\0\0"
    elif case == "req_idx_short":
        m["req_idx"] = m["req_idx"][:-4]
    elif case == "req_idx_ragged":
        m["req_idx"] = m["req_idx"][:-1]
    elif case == "req_idx_range":
        m["req_table"] = m["req_table"][:1]
    elif case == "req_table_missing":
        del m["req_table"]
    elif case == "column_missing":
        del m["positions"]


@pytest.mark.parametrize("case", [
    "encoding", "encoding_missing", "dtype", "data_short", "data_long", "shape_mismatch", "shape_3d",
    "meta_missing", "positions_short", "token_ids_long", "req_idx_short", "req_idx_ragged",
    "req_idx_range", "req_table_missing", "column_missing",
])
def test_deserialize_rejects(case):
    wire, _, labels = _payload()
    assert int(labels[:, 0].max()) > 0  # 'req_idx_range' needs an index beyond a 1-entry table
    _mutate(case, wire[3])
    with pytest.raises(ValueError) as err:
        deserialize_captured(wire)
    if case == "encoding":
        assert "versions" in str(err.value)


@pytest.mark.parametrize("key", ["x", "-1", "1.0", True, None])
def test_deserialize_rejects_bad_layer_keys(key):
    wire, _, _ = _payload()
    with pytest.raises(ValueError):
        deserialize_captured({key: wire[3]})


def test_deserialize_rejects_duplicate_layer_after_key_normalisation():
    wire, _, _ = _payload()
    with pytest.raises(ValueError):
        deserialize_captured({3: wire[3], "3": copy.deepcopy(wire[3])})


def test_wire_dtypes_table():
    assert WIRE_DTYPES["torch.bfloat16"] is torch.bfloat16
    assert {"torch.float32", "torch.float16", "torch.bfloat16"} <= set(WIRE_DTYPES)


# ---------------------------------------------------------------- CaptureMeta


def test_capture_meta_helpers():
    m = CaptureMeta(["a", "a", "b"], torch.tensor([0, 1, 0], dtype=torch.int32), [5, 6, -1])
    assert len(m) == 3 and m.token_ids.dtype == torch.int32
    assert m == CaptureMeta(["a", "a", "b"], [0, 1, 0], [5, 6, -1])
    assert m != CaptureMeta(["a", "a", "c"], [0, 1, 0], [5, 6, -1])
    assert m != CaptureMeta(["a", "a", "b"], [0, 1, 1], [5, 6, -1])
    assert "rows=3" in repr(m)
    assert m.select(slice(1, None)) == CaptureMeta(["a", "b"], [1, 0], [6, -1])
    assert m.select(torch.tensor([2, 0])) == CaptureMeta(["b", "a"], [0, 0], [-1, 5])
    assert m.select(torch.tensor([False, True, True])) == m.select(slice(1, 3))
    assert CaptureMeta.concat([m.select(slice(0, 1)), m.select(slice(1, 3))]) == m
    assert len(CaptureMeta.concat([])) == 0
    with pytest.raises(ValueError):
        CaptureMeta(["a"], [0, 1], [0])
    with pytest.raises(ValueError):
        m.select(torch.tensor([True, False]))


# ---------------------------------------------------------------- request-id matching


@pytest.mark.parametrize("label,rid,expected", [
    ("req-1", "req-1", True),
    ("req-1-deadbeef", "req-1", True),
    ("req-1-0123abcd", "req-1", True),
    ("0-00000000", "0", True),
    ("req-1-DEADBEEF", "req-1", False),      # uppercase hex is not the engine's suffix
    ("req-1-deadbee", "req-1", False),       # 7 hex
    ("req-1-deadbeef0", "req-1", False),     # 9 hex
    ("req-10-deadbeef", "req-1", False),     # different request sharing a prefix
    ("req-10", "req-1", False),
    ("req-1_deadbeef", "req-1", False),      # wrong separator
    ("req-1-deadbeeg", "req-1", False),      # not hex
    ("req-1-dead beef", "req-1", False),
    ("req-1-deadbeef", "req-1-deadbeef", True),
    ("req-1", "req-1-deadbeef", False),
    ("xreq-1-deadbeef", "req-1", False),
    ("req-1-١٢٣٤٥٦٧٨", "req-1", False),     # non-ASCII digits
])
def test_match_capture_request_id(label, rid, expected):
    assert match_capture_request_id(label, rid) is expected


# ---------------------------------------------------------------- FilesystemConsumer


def _capture(dtype=torch.bfloat16, layers=(0, 2), rows=4, width=6):
    tensors, meta = {}, {}
    for layer in layers:
        t, labels = _layer(rows, width, dtype, seed=layer + 1)
        tensors[layer] = t
        meta[layer] = _expected_meta(labels)
    return tensors, meta


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_filesystem_consumer_round_trip(tmp_path, dtype):
    c = FilesystemConsumer(tmp_path)
    assert isinstance(c, CaptureConsumer)
    tensors, meta = _capture(dtype)
    tensors[5], meta[5] = torch.empty(0, 6, dtype=dtype), CaptureMeta([], [], [])  # 0-row layer
    c.on_capture("req-1-deadbeef", "hidden_states", tensors, meta)
    (path,) = c.paths
    assert path.parent == tmp_path / "hidden_states" and path.suffix == ".safetensors"
    got_t, got_m = read_capture_shard(path)
    assert list(got_t) == [0, 2, 5]
    for layer in tensors:
        assert got_t[layer].dtype == dtype and torch.equal(got_t[layer], tensors[layer])
        assert got_m[layer] == meta[layer]
    # plain safetensors can read it too
    raw = load_file(str(path))
    assert set(raw) == {f"layer.{i}{s}" for i in (0, 2, 5) for s in ("", ".positions", ".token_ids", ".req_idx")}
    assert raw["layer.0.positions"].dtype == torch.int32 and raw["layer.0.req_idx"].dtype == torch.int32
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata()
    assert md["format"] == "steerable-capture-v1" and md["stream"] == "hidden_states"
    table = json.loads(md["request_ids"])
    assert [table[i] for i in raw["layer.2.req_idx"].tolist()] == meta[2].req_ids
    assert _files(tmp_path) == [os.path.join("hidden_states", path.name)]


def test_filesystem_consumer_accepts_views_of_one_buffer(tmp_path):
    buf = torch.randn(2, 3, 4)
    labels = torch.zeros(3, 3, dtype=torch.int32)
    meta = CaptureMeta(["r"] * 3, labels[:, 1], labels[:, 2])  # label views share storage as well
    c = FilesystemConsumer(tmp_path)
    c.on_capture("r", "hidden_states", {0: buf[0], 1: buf[1]}, {0: meta, 1: meta})
    t, m = read_capture_shard(c.paths[0])
    assert torch.equal(t[0], buf[0]) and torch.equal(t[1], buf[1]) and m[1] == meta


def test_filesystem_consumer_repeated_ids_do_not_overwrite(tmp_path):
    c = FilesystemConsumer(tmp_path)
    first, second = _capture(layers=(0,)), _capture(layers=(1,))
    c.on_capture("same", "hidden_states", *first)
    c.on_capture("same", "hidden_states", *second)
    assert len(set(c.paths)) == 2 and all(p.exists() for p in c.paths)
    assert list(read_capture_shard(c.paths[0])[0]) == [0]
    assert list(read_capture_shard(c.paths[1])[0]) == [1]
    # a fresh consumer on the same root keeps the earlier shards intact too
    c2 = FilesystemConsumer(tmp_path)
    c2.on_capture("same", "hidden_states", *second)
    assert c2.paths[0] not in c.paths and len(_files(tmp_path)) == 3
    assert list(read_capture_shard(c.paths[0])[0]) == [0]


@pytest.mark.parametrize("rid", ["../../etc/passwd", "/abs", "/abs/../../x", "a/b", "..", ".", ".hidden",
                                 "", "a\\b", "a\0b", "ünïcødé/файл", "x" * 1000, "~root", "C:\\evil"])
def test_filesystem_consumer_hostile_ids_stay_inside_root(tmp_path, rid):
    root = tmp_path / "root"
    c = FilesystemConsumer(root)
    c.on_capture(rid, "hidden_states", *_capture(layers=(0,)))
    (path,) = c.paths
    assert path.resolve().parent == (root / "hidden_states").resolve()
    assert not path.name.startswith(".") and len(path.name) < 200
    assert _files(tmp_path) == [os.path.join("root", "hidden_states", path.name)]
    assert read_capture_shard(path)[1][0].req_ids  # labels keep the original id untouched


@pytest.mark.parametrize("stream", ["../x", "..", "a/b", "/abs", "", "x.y", "ünï", "a b", "hidden_states\n"])
def test_filesystem_consumer_rejects_bad_streams(tmp_path, stream):
    c = FilesystemConsumer(tmp_path / "root")
    with pytest.raises(ValueError):
        c.on_capture("r", stream, *_capture(layers=(0,)))
    assert _files(tmp_path) == []


def test_filesystem_consumer_custom_stream_and_symlink_escape(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    c = FilesystemConsumer(root)
    c.on_capture("r", "my_probe_1", *_capture(layers=(0,)))
    assert c.paths[0].parent == root / "my_probe_1"
    (root / "attention_heads").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError):
        c.on_capture("r", "attention_heads", *_capture(layers=(0,)))
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("fail_at", ["save", "replace"])
def test_filesystem_consumer_is_atomic(tmp_path, monkeypatch, fail_at):
    c = FilesystemConsumer(tmp_path)
    c.on_capture("ok", "hidden_states", *_capture())
    before = _files(tmp_path)

    def partial_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial shard bytes")
        raise OSError("disk full")

    def failing_replace(src, dst):
        raise OSError("rename failed")

    if fail_at == "save":
        monkeypatch.setattr(consumers_mod, "write_safetensors", partial_save)
    else:
        monkeypatch.setattr(consumers_mod.os, "replace", failing_replace)
    with pytest.raises(OSError):
        c.on_capture("broken", "hidden_states", *_capture())
    assert _files(tmp_path) == before  # neither the shard nor its temp file remains
    assert len(c.paths) == 1


def test_filesystem_consumer_rejects_inconsistent_capture(tmp_path):
    c = FilesystemConsumer(tmp_path)
    tensors, meta = _capture(layers=(0, 1))
    with pytest.raises(ValueError):
        c.on_capture("r", "hidden_states", tensors, {0: meta[0]})
    with pytest.raises(ValueError):
        c.on_capture("r", "hidden_states", {0: tensors[0][:2]}, {0: meta[0]})
    assert _files(tmp_path) == []
    c.close()
    with pytest.raises(RuntimeError):
        c.on_capture("r", "hidden_states", tensors, meta)


def test_read_capture_shard_rejects_foreign_files(tmp_path):
    from safetensors.torch import save_file
    p = tmp_path / "foreign.safetensors"
    save_file({"layer.0": torch.zeros(1, 2)}, str(p))
    with pytest.raises(ValueError):
        read_capture_shard(p)
    save_file({"layer.0": torch.zeros(1, 2)}, str(p),
              metadata={"format": "steerable-capture-v1", "request_ids": "[\"r\"]", "stream": "s"})
    with pytest.raises(ValueError):  # labels missing
        read_capture_shard(p)


# ---------------------------------------------------------------- LoggingConsumer


def test_logging_consumer(caplog):
    logger = logging.getLogger("test.capture.consumer")
    c = LoggingConsumer(logger)
    assert isinstance(c, CaptureConsumer)
    with caplog.at_level(logging.INFO, logger=logger.name):
        c.on_capture("req-7", "hidden_states", *_capture(torch.bfloat16, layers=(0, 1, 2), rows=4, width=6))
        tensors, meta = _capture(torch.float32, layers=(3,), rows=2, width=8)
        c.on_capture("req-8", "attention_heads", tensors, meta)
    assert len(caplog.records) == 2
    first, second = caplog.records[0].getMessage(), caplog.records[1].getMessage()
    for s in ("req-7", "hidden_states", "layers=3", "rows=4", "bfloat16", "width=6"):
        assert s in first
    for s in ("req-8", "attention_heads", "layers=1", "rows=2", "float32", "width=8"):
        assert s in second
    assert c.num_captures == 2 and c.num_rows == 3 * 4 + 2
    c.close()


def test_logging_consumer_counts_when_level_disabled(caplog):
    logger = logging.getLogger("test.capture.quiet")
    c = LoggingConsumer(logger, level=logging.DEBUG)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        c.on_capture("r", "hidden_states", *_capture(rows=3, layers=(0, 1)))
    assert caplog.records == [] and c.num_captures == 1 and c.num_rows == 6
