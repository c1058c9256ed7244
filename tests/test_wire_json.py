"""The JSON forms a server speaks (issue 10): ``SteeringSpec.to_dict`` / ``from_dict`` round-trip
every field, vectors travel as float lists or base64 (float32, float16, bfloat16), unknown keys are
errors naming the key, captures round-trip as base64 JSON through ``deserialize_captured``, and a
request's own capture can be reduced (``reduce``, ``budget_rows``) as a stream's can."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from steerable import LLM, Add, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.capture.serialization import CaptureMeta, deserialize_captured, serialize_captured
from steerable.errors import InvalidRequestError
from steerable.steering.spec import SpecParser
from steerable.steering.wire import decode_vector, steering_from_json

H = 64


def vec(seed: int) -> torch.Tensor:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed))


FULL = SteeringSpec(
    interventions=[Add(1, vec(0), hook="pre_attn", scale=2.0, select=SelectSpec(prompt_positions=[-1])),
                   Add(2, vec(1), select="all_generated"),
                   Clamp(0, vec(2), hook="post_attn", min=-1.0, max=0.5, strength=0.5,
                         select=SelectSpec(generation_window=(0, 3)))],
    vectors={2: vec(3)}, prefill_vectors={"post_attn": {1: {"vector": vec(4), "scale": 0.5}}},
    decode_vectors={"pre_attn": {0: vec(5)}}, clamps=[Clamp(1, vec(6), min=0.0, max=0.0)], scale=0.75)


def digests(spec) -> list[bytes]:
    return [item.digest for item in SpecParser(H, 3).parse(spec, "s")]


@pytest.mark.parametrize("encoding", ["list", "base64"])
def test_spec_round_trips_through_json(encoding):
    data = json.loads(json.dumps(FULL.to_dict(encoding=encoding)))
    assert set(data) == {"interventions", "vectors", "prefill_vectors", "decode_vectors", "clamps", "scale"}
    again = SteeringSpec.from_dict(data)
    assert again.to_dict(encoding=encoding) == data
    assert digests(again) == digests(FULL)  # the same interventions, vectors bit for bit
    assert data["interventions"][0]["select"] == {"prompt_positions": [-1]}
    assert steering_from_json(data).to_dict() == FULL.to_dict()


def test_shorthand_json_forms_parse_as_their_python_forms():
    v = vec(7)
    assert digests(steering_from_json({"1": v.tolist()})) == digests({1: v})
    encoded = {"post_attn": {"2": {"vector": {"dtype": "float32", "shape": [H],
                                              "data": base64.b64encode(v.numpy().tobytes()).decode()},
                                   "scale": 0.5}}}
    assert digests(steering_from_json(encoded)) == digests({"post_attn": {2: {"vector": v, "scale": 0.5}}})


@pytest.mark.parametrize("dtype, torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_half_precision_vectors_decode_exactly(dtype, torch_dtype):
    v = vec(8).to(torch_dtype)
    raw = v.view(torch.int16).numpy().astype("<i2").tobytes()
    decoded = decode_vector({"dtype": dtype, "shape": [H], "data": base64.b64encode(raw).decode()}, "v")
    assert decoded.dtype == np.float32 and torch.equal(torch.from_numpy(decoded), v.float())


@pytest.mark.parametrize("data, where", [
    ({"vectors": {"1": [0.0] * H}, "scales": 1}, "steering.scales"),
    ({"interventions": [{"type": "add", "layer": 1, "vector": [0.0] * H, "hok": "pre_attn"}]},
     "steering.interventions[0].hok"),
    ({"interventions": [{"type": "nudge", "layer": 1}]}, "steering.interventions[0].type"),
    ({"interventions": [{"type": "add", "layer": 1}]}, "steering.interventions[0]"),
    ({"clamps": [{"layer": 1, "direction": [1.0] * H, "mn": 0}]}, "steering.clamps[0].mn"),
    ({"vectors": {"1": {"vector": [0.0] * H, "scal": 2}}}, "steering.vectors[1].scal"),
    ({"vectors": {"1": {"dtype": "float64", "shape": [H], "data": ""}}}, "steering.vectors[1].vector.dtype"),
    ({"vectors": {"1": {"dtype": "float32", "shape": [H], "data": "not base64!"}}}, "steering.vectors[1].vector.data"),
    ({"vectors": {"1": {"dtype": "float32", "shape": [H], "data": "AAAA"}}}, "steering.vectors[1].vector.data"),
    ({"vectors": {"1": "abc"}}, "steering.vectors[1].vector"),
    ({"interventions": [{"type": "add", "layer": 1, "vector": [0.0] * H, "select": {"prompt": "most"}}]},
     "steering.interventions[0].select"),
])
def test_bad_json_names_the_key(data, where):
    with pytest.raises(InvalidRequestError) as err:
        SteeringSpec.from_dict(data)
    assert str(err.value).startswith(where), err.value


def test_captures_round_trip_as_base64_json():
    tensors = {3: torch.randn(4, 8).to(torch.bfloat16), 1: torch.randn(2, 8)}
    metas = {3: CaptureMeta(["r-0000000a"] * 4, [0, 1, 2, 5], [7, 8, 9, 10]),
             1: CaptureMeta(["a", "b"], [-1, 4], [-1, 3])}
    wire = json.loads(json.dumps(serialize_captured(tensors, metas, {3: {"width": 8}}, text=True)))
    assert set(wire) == {"1", "3"} and wire["3"]["layout"] == {"width": 8} and isinstance(wire["3"]["data"], str)
    back, back_meta = deserialize_captured(wire)
    for layer in tensors:
        assert torch.equal(back[layer], tensors[layer]) and back_meta[layer] == metas[layer]
    raw, raw_meta = deserialize_captured(serialize_captured(tensors, metas))  # bytes, as before
    assert torch.equal(raw[3], tensors[3]) and raw_meta[1] == metas[1]
    wire["1"]["data"] = "%%%"
    with pytest.raises(InvalidRequestError, match="base64"):
        deserialize_captured(wire)


def test_request_capture_reductions(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024)

    def captured(**spec):
        out = llm.generate("Hello world", SamplingParams(max_tokens=5, temperature=0, capture=CaptureSpec(
            layers=[1], select="all_generated", **spec)), use_tqdm=False)[0]
        return out.captures["hidden_states"][1], out.capture_meta["hidden_states"][1]

    rows, meta = captured()
    last, last_meta = captured(reduce="last")
    assert torch.equal(last, rows[-1:]) and last_meta.positions.tolist() == meta.positions.tolist()[-1:]
    stored, _ = captured(dtype="bfloat16")
    mean, mean_meta = captured(reduce="mean", dtype="bfloat16")  # the float32 mean of the stored rows
    assert torch.equal(mean, (stored.float().sum(0) / len(stored)).to(torch.bfloat16)[None])
    assert mean_meta.positions.tolist() == [-1] and mean_meta.token_ids.tolist() == [-1]
    budget, _ = captured(budget_rows=2)
    assert torch.equal(budget, rows[:2])
    for spec, field in ((dict(reduce="max"), "capture.reduce"), (dict(budget_rows=-1), "capture.budget_rows")):
        with pytest.raises(InvalidRequestError, match=field):
            captured(**spec)
