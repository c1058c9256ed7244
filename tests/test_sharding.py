"""The pieces of tensor/pipeline parallelism that need no second process: the layer partition and
site ownership, the step encoding, and each rank's shard of the weights (safetensors and GGUF),
read without reading the rest."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from steerable import LLM
from steerable.executor.channel import FRAME_BYTES, Kind, _frame, _join, _parse
from steerable.executor.codec import decode, encode
from steerable.distributed.groups import ParallelContext, TPGroup, building
from steerable.distributed.placement import (
    MICRO_BATCHES_ENV,
    PARTITION_ENV,
    Placement,
    layer_partition,
    pipeline_micro_batches,
)
from steerable.hook_points import HookPoints
from steerable.layers.attention_backends import torch_ref
from steerable.layers.checkpoint import CheckpointTensor
from steerable.models.loader import iter_weights, load_hf_config, resolve_model
from steerable.models.registry import resolve_model_config
from steerable.step import (
    BlockTableUpdate,
    CaptureGroup,
    CapturePlan,
    PenaltyInput,
    SamplingInput,
    SteeringPlan,
    SteeringUpdate,
    StepInput,
    StepOutput,
    TableWrite,
)

# ---------------------------------------------------------------- placement


def test_layer_partition_default_and_override(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert layer_partition(3, 2) == [(0, 2), (2, 3)]
    assert layer_partition(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]  # leftovers before the last stage
    assert layer_partition(36, 2) == [(0, 18), (18, 36)]
    monkeypatch.setenv(PARTITION_ENV, "1,2")
    assert layer_partition(3, 2) == [(0, 1), (1, 3)]
    for bad in ("1,1", "3", "a,b", "0,3"):
        monkeypatch.setenv(PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PARTITION_ENV):
            layer_partition(3, 2)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        layer_partition(3, 4)


@pytest.mark.parametrize("size", [0, 100, FRAME_BYTES - 16, FRAME_BYTES - 15, 3 * FRAME_BYTES])
def test_a_message_survives_its_frames(size):
    """A payload split into a frame and the rest (as a channel sends it) joins back byte for byte,
    into a buffer of its own."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    frame, rest = _frame(Kind.REPORT, payload)
    assert frame.shape == (FRAME_BYTES,) and (rest is None) == (size <= FRAME_BYTES - 16)
    kind, length, first = _parse(frame.clone())  # as received: a tensor of its own
    joined = _join(first, None if rest is None else rest.clone())
    assert kind is Kind.REPORT and length == size and bytes(joined) == payload and not joined.readonly


def test_pipeline_micro_batches_default_and_override(monkeypatch):
    monkeypatch.delenv(MICRO_BATCHES_ENV, raising=False)
    assert [pipeline_micro_batches(p) for p in (1, 2, 4)] == [1, 2, 4]  # one per stage
    monkeypatch.setenv(MICRO_BATCHES_ENV, "3")
    assert pipeline_micro_batches(2) == 3 and pipeline_micro_batches(1) == 1
    for bad in ("1", "x"):
        monkeypatch.setenv(MICRO_BATCHES_ENV, bad)
        with pytest.raises(ValueError, match=MICRO_BATCHES_ENV):
            pipeline_micro_batches(2)


def test_sites_belong_to_the_stage_that_runs_them():
    """A layer's post_mlp add happens in the next layer's first norm: on the next stage for a
    stage's last layer; the last stage also forms the final layer's."""
    first, last = (Placement.of(rank, 2, [(0, 2), (2, 3)]) for rank in (1, 2))
    assert (first.tp_rank, first.stage, last.tp_rank, last.stage) == (1, 0, 0, 1)
    assert [first.owns(s) for s in [("pre_attn", 0), ("post_mlp", 0), ("attention_heads", 1), ("post_mlp", 1)]] \
        == [True, True, True, False]
    assert [last.owns(s) for s in [("post_mlp", 1), ("pre_attn", 2), ("router_logits", 2), ("post_mlp", 2),
                                   ("pre_attn", 1)]] == [True, True, True, True, False]
    plan = CapturePlan([CaptureGroup("post_mlp", (0,), None, np.array([0]))])
    step = StepInput(0, *[np.zeros(1, np.int64)] * 3, np.array([0, 1]), np.array([1]), np.array([0]), 1, capture=plan)
    assert not last.reports(step)  # nothing of the plan runs there, nothing sampled
    step.capture = CapturePlan([CaptureGroup("post_mlp", (1,), None, np.array([0]))])
    assert last.reports(step) and not Placement.of(3, 2, [(0, 2), (2, 3)]).reports(step)  # rank 0 of the stage


# ---------------------------------------------------------------- the step encoding


def _step() -> StepInput:
    site = ("post_mlp", 1)
    return StepInput(
        7, np.array([5, -1, 9]), np.arange(3), np.array([16, 17, 40]), np.array([0, 2, 3]), np.array([2, 9]),
        np.array([3, 0]), 2, BlockTableUpdate(np.array([3]), np.array([0]), np.array([11])),
        SamplingInput(np.array([1, 2]), np.array([3, 0]), np.array([0.0, 0.7], np.float32),
                      np.array([1.0, 0.9], np.float32), np.array([0, 5]), np.zeros(2, np.float32),
                      np.array([1 << 62, 3]), [None, 2], {1: np.array([2])},
                      [PenaltyInput(1, np.array([5, 9]), np.array([4]), 1.1, 0.5, 0.0)]),
        SteeringUpdate(8, 4, np.arange(17, dtype=np.float32), [TableWrite("add", *site, 0, 2, 0),
                       TableWrite("clamp", "pre_attn", 0, 0, 1, 2, 0, 1, False)], 2, 3, 3),
        SteeringPlan(np.array([0, 1, 2]), frozenset({site}), frozenset({("pre_attn", 0)}), 3),
        CapturePlan([CaptureGroup("attention_heads", (0, 2), "bfloat16", np.array([0, 2]))]))


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_step_input_and_output_round_trip():
    step = _step()
    assert _equal(decode(bytearray(encode(step))), step)
    output = StepOutput(7, [4, 8], [None, {8: (-0.25, 1), 3: (-1.5, 2)}],
                        {(0, 2): torch.randn(2, 8).to(torch.bfloat16), (1, 0): torch.randn(1, 3)}, True)
    assert _equal(decode(bytearray(encode(output))), output)


@pytest.mark.parametrize("tree", [
    '{"dc": "Popen", "f": {}}',  # only the step dataclasses are built
    '{"nd": ["object", [1]]}',  # no object arrays
    '{"t": ["complex64", [1]]}',
    '{"nd": ["int64", [1000]]}',  # more bytes than the message has
    '{"x": 1}',
])
def test_malformed_messages_are_refused(tree):
    header = tree.encode()
    with pytest.raises(ValueError, match="malformed step message"):
        decode(bytearray(np.array([len(header)], "<u8").tobytes() + header))
    with pytest.raises(TypeError):
        encode(object())


# ---------------------------------------------------------------- shards of the weights


def test_a_checkpoint_tensor_reads_only_the_narrowed_box():
    full = torch.arange(24.0).reshape(4, 6)
    boxes = []

    def read(box):
        boxes.append(box)
        return full[tuple(slice(a, b) for a, b in box)]

    part = CheckpointTensor((4, 6), read).narrow(0, 2, 2).narrow(1, 3, 3)
    assert part.shape == (2, 3) and torch.equal(part.load(), full[2:4, 3:6])
    assert boxes == [((2, 4), (3, 6))]
    with pytest.raises(ValueError, match="outside shape"):
        part.narrow(1, 2, 2)


def _config(path: str):
    return resolve_model_config(load_hf_config(resolve_model(path)))


def _shard(path: str, rank: int, tp: int, partition: list[tuple[int, int]]):
    """Rank ``rank``'s model (no KV cache, no collectives) loaded from ``path``."""
    cls, cfg = _config(path)
    context = ParallelContext(Placement.of(rank, tp, partition), TPGroup(rank % tp, tp))
    with building(context):
        model = cls(cfg, HookPoints(), torch_ref, 64)
    model.load_weights(iter_weights(resolve_model(path), cfg.num_heads, cfg.num_kv_heads, torch.float32))
    return model.state_dict(), cfg


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    import glob
    state = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        state.update({k.removeprefix("model."): v for k, v in load_file(f).items()})
    return state


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tensor_parallel_shards_are_slices_of_each_part(model_dirs, family):
    """q|k|v and gate|up keep each part's slice (never a slice of the stacked rows), o_proj and
    down_proj their input columns, embedding and head their vocabulary block."""
    full = _hf_state(model_dirs[family])
    num_layers = _config(model_dirs[family])[1].num_layers
    for rank in range(2):
        shard, cfg = _shard(model_dirs[family], rank, 2, [(0, num_layers)])
        q, kv = cfg.num_heads * cfg.head_dim // 2, cfg.num_kv_heads * cfg.head_dim // 2
        rows = slice(rank * q, (rank + 1) * q)
        kv_rows = slice(rank * kv, (rank + 1) * kv)
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            qkv = torch.cat([full[p + "self_attn.q_proj.weight"][rows], full[p + "self_attn.k_proj.weight"][kv_rows],
                             full[p + "self_attn.v_proj.weight"][kv_rows]])
            assert torch.equal(shard[p + "self_attn.qkv_proj.weight"], qkv)
            assert torch.equal(shard[p + "self_attn.o_proj.weight"], full[p + "self_attn.o_proj.weight"][:, rows])
            i = cfg.intermediate_size // 2
            gate_up = torch.cat([full[p + "mlp.gate_proj.weight"][rank * i:(rank + 1) * i],
                                 full[p + "mlp.up_proj.weight"][rank * i:(rank + 1) * i]])
            assert torch.equal(shard[p + "mlp.gate_up_proj.weight"], gate_up)
            down = full[p + "mlp.down_proj.weight"][:, rank * i:(rank + 1) * i]
            assert torch.equal(shard[p + "mlp.down_proj.weight"], down)
        v = cfg.vocab_size // 2
        assert torch.equal(shard["embed_tokens.weight"], full["embed_tokens.weight"][rank * v:(rank + 1) * v])


def test_one_kv_head_is_replicated_and_stages_hold_their_layers(tmp_path):
    """With fewer KV heads than ranks both ranks keep the one head; a later stage holds only its
    layers and, with tied embeddings, loads the head from the embedding tensor."""
    import transformers
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    full = _hf_state(str(tmp_path))
    for rank in range(2):
        shard, _ = _shard(str(tmp_path), rank, 2, [(0, 3)])
        k = full["layers.0.self_attn.k_proj.weight"]
        assert torch.equal(shard["layers.0.self_attn.qkv_proj.weight"][16:32], k)
    stage, _ = _shard(str(tmp_path), 1, 1, [(0, 2), (2, 3)])
    assert {k.split(".")[1] for k in stage if k.startswith("layers.")} == {"2"}
    assert "embed_tokens.weight" not in stage and torch.equal(stage["lm_head.weight"], full["embed_tokens.weight"])
    first, _ = _shard(str(tmp_path), 0, 1, [(0, 2), (2, 3)])
    assert "lm_head.weight" not in first and "norm.weight" not in first


def test_experts_are_split_over_the_ranks(tmp_path):
    from test_qwen3_moe import build_qwen3_moe
    build_qwen3_moe(str(tmp_path), seed=1, num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=1)
    full = _hf_state(str(tmp_path))
    for rank in range(2):
        shard, cfg = _shard(str(tmp_path), rank, 2, [(0, 2)])
        local = cfg.num_experts // 2
        for e in range(local):
            expert = rank * local + e
            gate_up = torch.cat([full[f"layers.0.mlp.experts.{expert}.gate_proj.weight"],
                                 full[f"layers.0.mlp.experts.{expert}.up_proj.weight"]])
            assert torch.equal(shard["layers.0.mlp.experts_gate_up"][e], gate_up)
            down = full[f"layers.0.mlp.experts.{expert}.down_proj.weight"]
            assert torch.equal(shard["layers.0.mlp.experts_down"][e], down)
        assert torch.equal(shard["layers.0.mlp.gate.weight"], full["layers.0.mlp.gate.weight"])  # the router: replicated


def test_gguf_slices_equal_slices_of_the_whole_tensor(tmp_path):
    """Row and column slices read from the memory map (block-aligned or not, through Q8_0, F16,
    BF16 and llama.cpp's q/k row order) equal the same slices of the fully read tensor."""
    pytest.importorskip("gguf")
    from test_gguf import _write_tiny

    from steerable.models.gguf import iter_gguf_slices

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, "llama")
    heads, kv_heads, head_dim = 4, 2, 16
    checked = 0
    for name, tensor in iter_gguf_slices(str(path), torch.float32, heads, kv_heads):
        whole = tensor.load()
        if whole.dim() != 2:
            continue
        rows = head_dim * (2 if "q_proj" in name else 1)  # whole heads for the permuted q/k
        assert torch.equal(tensor.narrow(0, rows, rows).load(), whole[rows:2 * rows]), name
        for start, length in ((32, 32), (8, 24)):  # on and off the 32-wide Q8_0 blocks
            assert torch.equal(tensor.narrow(1, start, length).load(), whole[:, start:start + length]), name
        checked += 1
    assert checked >= 10


def test_engine_rejects_bad_sizes(model_dirs):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(model_dirs["llama"], device="cpu", tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        LLM(model_dirs["llama"], device="cpu", pipeline_parallel_size=4)
