"""The routes the playground builds on (issue 14), against the shared test server: the page itself,
``GET /v1/auth``, ``GET /v1/steering/modules/{name}``, ``POST /v1/vectors/train`` (admin) and
``POST /v1/vectors/evaluate`` (user). Trained vectors and sweeps equal ``steerable.vectors`` run
offline on the same model; bad input is a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import sys

import httpx
import numpy as np
import pytest
import torch
from server_harness import ADMIN, ADMIN_KEY, USER, USER_KEY, assert_nothing_held

from steerable import AsyncLLM, Clamp, SamplingParams, SteeringSpec
from steerable.entrypoints.openai.blocking_llm import BlockingLLM
from steerable.entrypoints.openai.errors import ClientDisconnected
from steerable.entrypoints.openai.protocol import MAX_EVAL_ITEMS, MAX_TEXT_CHARS, MAX_TRAIN_PAIRS
from steerable.steering.wire import decode_vector
from steerable.vectors import ControlVector, evaluate, train
from steerable.vectors.files import load_bytes

POSITIVES = ["I love this place.", "What a wonderful day.", "The food was delicious.", "They were so kind."]
NEGATIVES = ["I hate this place.", "What a terrible day.", "The food was disgusting.", "They were so rude."]
ITEMS = [{"prompt": "The quick brown", "matching": " fox", "other": " dog"},
         {"question": "Pick one.\n(A) fox\n(B) dog", "matching": "B"}]


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_page_is_served_at_root_and_playground(http):
    pages = [http.get(path) for path in ("/", "/playground")]
    for r in pages:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
    assert pages[0].text == pages[1].text and USER_KEY not in pages[0].text and ADMIN_KEY not in pages[0].text
    for asset, kind in [("playground.js", "javascript"), ("playground.css", "text/css")]:
        assert f'static/{asset}' in pages[0].text
        r = http.get(f"/static/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert error(http.get("/static/nothing.js"), 404)


def test_auth_tells_the_role_of_a_key(http):
    assert http.get("/v1/auth", headers=ADMIN).json() == {"role": "admin", "admin_routes": True}
    assert http.get("/v1/auth", headers=USER).json() == {"role": "user", "admin_routes": True}
    assert error(http.get("/v1/auth"), 401)["type"] == "AuthenticationError"
    assert error(http.get("/v1/auth", headers={"Authorization": "Bearer nope"}), 401)


def test_module_route_gives_what_the_module_adds(http, offline):
    g = torch.Generator().manual_seed(5)
    v, d = torch.randn(64, generator=g), torch.randn(64, generator=g)
    spec = SteeringSpec(vectors={"post_attn": {1: v}}, clamps=[Clamp(2, d, min=-1.0)], scale=0.5)
    assert http.post("/v1/steering/modules", json={"pg-mixed": spec.to_dict("base64")}, headers=ADMIN).status_code == 200
    try:
        body = http.get("/v1/steering/modules/pg-mixed", headers=USER).json()
    finally:
        http.delete("/v1/steering/modules/pg-mixed", headers=ADMIN)
    add, clamp = body["spec"]["interventions"]
    assert (add["type"], add["hook"], add["layer"], clamp["type"], clamp["min"], clamp["max"], clamp["strength"]) == \
        ("add", "post_attn", 1, "clamp", -1.0, None, 0.5)
    np.testing.assert_array_equal(decode_vector(add["vector"], "v"), (v * 0.5).numpy())
    np.testing.assert_allclose(decode_vector(clamp["direction"], "d"), (d / d.norm()).numpy(), rtol=0, atol=1e-7)
    assert error(http.get("/v1/steering/modules/pg-mixed", headers=USER), 404)["param"] == "name"
    # Offline too: the spec registers again as the same module.
    offline.register_steering_modules({"a": spec})
    offline.register_steering_modules({"b": offline.get_steering_module("a")})
    try:
        outs = [offline.generate("Hello world", SamplingParams(max_tokens=6, temperature=0, steering_module_ref=name),
                                 use_tqdm=False)[0].outputs[0].token_ids for name in ("a", "b")]
    finally:
        offline.unregister_steering_modules(["a", "b"])
    assert outs[0] == outs[1]


def test_train_route_equals_offline_train_and_registers(http, offline):
    body = {"positives": POSITIVES, "negatives": NEGATIVES, "layers": [1, 2], "method": "pca_diff", "module": "pg-happy"}
    assert error(http.post("/v1/vectors/train", json=body, headers=USER), 403)
    r = http.post("/v1/vectors/train", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    try:
        answer = r.json()
        served = load_bytes(base64.b64decode(answer["control_vector"]))
        registered = http.get("/v1/steering/modules/pg-happy", headers=USER).json()["spec"]["interventions"]
    finally:
        http.delete("/v1/steering/modules/pg-happy", headers=ADMIN)
    ref = train(offline, POSITIVES, NEGATIVES, layers=[1, 2], method="pca_diff")
    assert (answer["module"], answer["hook"], answer["layers"], answer["width"]) == ("pg-happy", "post_mlp", [1, 2], 64)
    assert answer["metadata"] == {"method": "pca_diff", "pairs": 4, "token": "last", "model_hint": "qwen3"}
    for layer in (1, 2):
        torch.testing.assert_close(served.directions[layer], ref.directions[layer], rtol=0, atol=1e-6)
        assert answer["residual_norm"][str(layer)] == pytest.approx(ref.metadata["residual_norm"][layer], rel=1e-6)
    assert [(item["layer"], item["hook"]) for item in registered] == [(1, "post_mlp"), (2, "post_mlp")]
    np.testing.assert_array_equal(decode_vector(registered[0]["vector"], "v"), served.directions[1].numpy())


@pytest.mark.parametrize("change, param", [
    ({"positives": POSITIVES[:3]}, "positives"),
    ({"positives": ["x" * (MAX_TEXT_CHARS + 1)] * 4}, "positives.0"),
    ({"positives": ["x"] * (MAX_TRAIN_PAIRS + 1), "negatives": ["y"] * (MAX_TRAIN_PAIRS + 1)}, "positives"),
    ({"layers": [1, 7]}, "layers"),
    ({"hook": "post_ffn"}, "hook"),
    ({"method": "svd"}, "method"),
    ({"module": ""}, "module"),
    ({"scale": 2}, "scale"),
])
def test_train_route_refuses_bad_input(http, change, param):
    body = {"positives": POSITIVES, "negatives": NEGATIVES, **change}
    err = error(http.post("/v1/vectors/train", json=body, headers=ADMIN), 400)
    assert err["param"] == param and param.split(".")[0] in err["message"]


def test_evaluate_route_equals_offline_evaluate(http, offline, tmp_path):
    g = torch.Generator().manual_seed(9)
    cv = ControlVector({1: torch.randn(64, generator=g) * 2, 2: torch.randn(64, generator=g) * 2})
    cv.save(tmp_path / "v.safetensors")
    data = base64.b64encode((tmp_path / "v.safetensors").read_bytes()).decode()
    assert http.post("/v1/steering/modules", json={"pg-cv": {"control_vector": data}}, headers=ADMIN).status_code == 200
    try:
        r = http.post("/v1/vectors/evaluate", json={"module": "pg-cv", "items": ITEMS, "scales": [-1, 0, 2]},
                      headers=USER)
        bad_items = http.post("/v1/vectors/evaluate", json={"module": "pg-cv", "items": [{"prompt": "x"}]}, headers=USER)
        too_many = http.post("/v1/vectors/evaluate", json={"module": "pg-cv", "items": ITEMS * MAX_EVAL_ITEMS},
                             headers=USER)
        bad_scale = http.post("/v1/vectors/evaluate", json={"module": "pg-cv", "items": ITEMS, "scales": ["x"]},
                              headers=USER)
    finally:
        http.delete("/v1/steering/modules/pg-cv", headers=ADMIN)
    assert r.status_code == 200, r.text
    ref = evaluate(offline, cv, ITEMS, scales=[-1, 0, 2])
    report = r.json()
    assert report["items"] == 2 and report["markdown"].splitlines()[0].startswith("| scale")
    for row, expected in zip(report["rows"], ref.rows):
        assert row["scale"] == expected.scale and row["wrong_way"] == expected.wrong_way
        assert row["p_match"] == pytest.approx(expected.p_match, abs=1e-5)
        assert row["logit_diff"] == pytest.approx(expected.logit_diff, abs=1e-4)
        assert row["kl"] == pytest.approx(expected.kl, abs=1e-4)
    assert report["steerability"] == pytest.approx(ref.steerability, abs=1e-4)
    assert error(bad_items, 400)["param"] == "items[0]"
    assert error(too_many, 400)["param"] == "items"
    assert error(bad_scale, 400)["param"] == "scales.0"
    assert error(http.post("/v1/vectors/evaluate", json={"module": "pg-none", "items": ITEMS}, headers=USER),
                 404)["param"] == "module"


def test_evaluate_needs_a_plain_control_vector(http):
    clamp = SteeringSpec(clamps=[Clamp(1, torch.ones(64), min=0.0)]).to_dict("base64")
    assert http.post("/v1/steering/modules", json={"pg-clamp": clamp}, headers=ADMIN).status_code == 200
    try:
        err = error(http.post("/v1/vectors/evaluate", json={"module": "pg-clamp", "items": ITEMS}, headers=USER), 400)
    finally:
        http.delete("/v1/steering/modules/pg-clamp", headers=ADMIN)
    assert err["param"] == "module" and "plain control vector" in err["message"]
    assert_nothing_held(http)


def test_blocking_llm_cancel_aborts_the_batch_in_flight(model_dirs):
    """A client that leaves a training run or a sweep: its requests are aborted at once."""

    async def main():
        async with AsyncLLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=8192) as llm:
            view = BlockingLLM(llm, asyncio.get_running_loop())
            params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
            work = asyncio.ensure_future(asyncio.to_thread(view.generate, ["Hello world", "Steering"], params))
            while (await llm.stats())["num_running"] < 2:
                await asyncio.sleep(0.01)
            view.cancel()
            with pytest.raises(ClientDisconnected):
                await work
            stats = await llm.stats()
            assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
            with pytest.raises(ClientDisconnected):  # and it starts nothing more
                await asyncio.to_thread(view.generate, ["Hello"], params)

    asyncio.run(main())


@pytest.mark.parametrize("missing", ["chromium", "playwright"])
@pytest.mark.parametrize("env, outcome", [({}, pytest.skip.Exception), ({"CI": "true"}, pytest.fail.Exception),
                                          ({"STEERABLE_REQUIRE_BROWSER": "1"}, pytest.fail.Exception)])
def test_a_missing_browser_fails_on_ci_and_skips_elsewhere(monkeypatch, env, outcome, missing):
    import importlib.util

    import browser_harness
    if missing == "chromium":
        monkeypatch.setattr(browser_harness, "CHROMIUM", "/nonexistent/chromium")
    else:  # a browser that exists, so that only playwright is missing
        monkeypatch.setattr(browser_harness, "CHROMIUM", sys.executable)
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "playwright"
                            else find_spec(name, *a))
    for name in ("CI", "STEERABLE_REQUIRE_BROWSER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(outcome, match=f"need {'/nonexistent/chromium' if missing == 'chromium' else 'playwright'}: "
                       "apt-get install -y chromium"):
        browser_harness.require_browser()
