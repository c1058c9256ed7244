"""The playground's SAE-feature and attention views (issues 27 and 29) in headless Chromium against
the shared test server, with an SAE registered from its files (``POST /v1/saes``). What the page
shows must equal the API for the same request: each heatmap cell's feature activation and its top
features, the feature-steered completion; and each hovered query's attention weights must equal
the offline capture of that row (and sum to 1). Select with ``-m browser``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from browser_harness import api_run, browser, choose_module, enter_key, expect, page, press_run, shots  # noqa: F401
from server_harness import ADMIN, USER_KEY
from test_sae_registry import random_sae, save_saelens

from steerable import CaptureSpec, SamplingParams
from steerable.capture import deserialize_captured
from steerable.steering.wire import steering_from_json

pytestmark = pytest.mark.browser

SAE_NAME = "pg-sae"
PROMPT = "The quick brown fox jumps over"
TOP_K = 6


@pytest.fixture(scope="module")
def sae(http, offline, tmp_path_factory):
    """A jumprelu SAE at layer 1's output, registered on the server from a SAELens directory and
    offline under the same name; unregistered from both at the end."""
    model = random_sae(layer=1, hook="post_mlp", apply_b_dec_to_input=True, seed=4)
    folder = tmp_path_factory.mktemp("pg-sae")
    save_saelens(model, folder)
    r = http.post("/v1/saes", json={SAE_NAME: {"path": str(folder)}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    offline.register_sae(SAE_NAME, model)
    yield model
    offline.unregister_sae(SAE_NAME)
    assert http.delete(f"/v1/saes/{SAE_NAME}", headers=ADMIN).status_code == 200


def fill_run(page, prompt: str, max_tokens: int, temperature: float, seed: int) -> None:
    for selector, value in [("#prompt", prompt), ("#max-tokens", str(max_tokens)), ("#temperature", str(temperature)),
                            ("#seed", str(seed))]:
        page.fill(selector, value)


def move_slider(page, selector: str, steps: int) -> None:
    page.focus(selector)
    for _ in range(abs(steps)):
        page.keyboard.press("ArrowRight" if steps > 0 else "ArrowLeft")


def press_run_expecting_error(page) -> None:
    page.click("#run")
    expect(page.locator("#sae-error")).not_to_be_empty()
    assert page.text_content("#run-status") == ""


def cell_values(page, row: str) -> list[str]:
    """What follows the token and position in each heatmap cell's hover text."""
    titles = page.eval_on_selector_all(f"#heat-{row} span", "cells => cells.map(c => c.title)")
    return [re.fullmatch(r'".*" at position \d+: (.*)', title, flags=re.S).group(1) for title in titles]


def readout_features(page, row: str) -> list[list[tuple[int, float]]]:
    """Each cell's top features as the readout lists them, walking the row with the arrow keys."""
    cells = page.locator(f"#heat-{row} span")
    cells.first.focus()
    out = []
    for i in range(cells.count()):
        if i:
            page.keyboard.press("ArrowRight")
        expect(page.locator("#heat-readout")).to_have_text(cells.nth(i).get_attribute("title"))
        text = page.text_content("#heat-features")
        out.append([(int(index), float(value)) for index, value in re.findall(r"#(\d+) (-?[\d.]+)", text)])
    return out


def api_features(choice: dict, name: str = SAE_NAME) -> list[list[tuple[int, float]]]:
    tensors, _ = deserialize_captured(choice["captures"]["sae_features"])
    feats = tensors[name]
    return [[(int(i), float(v)) for i, v in zip(idx, val) if i >= 0]
            for idx, val in zip(feats.indices.tolist(), feats.values.tolist())]


def check_features(page, row: str, expected: list[list[tuple[int, float]]]) -> None:
    shown = readout_features(page, row)
    assert len(shown) == len(expected) > 0
    for got, want in zip(shown, expected):
        assert [i for i, _ in got] == [i for i, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=0, atol=1e-3)


def test_feature_heatmap_hover_list_and_feature_steering_equal_the_api(page, http, sae, shots):
    """No module: the steered run steers one feature at the slider's scale; the heatmap is coloured
    by another feature's activation; each cell's value and top features equal the API's capture."""
    base = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.7, "seed": 3,
            "capture": [{"stream": "sae_features", "saes": [SAE_NAME], "top_k": TOP_K, "select": "all"}]}
    plain = api_run(http, "/v1/completions", base)
    counts = np.bincount([i for row in api_features(plain) for i, _ in row], minlength=sae.d_sae)
    shown_feature, steered_feature = int(counts.argmax()), int(counts.argmin())  # often active; rarely
    steer = {"steering_vectors": {"features": [{"sae": SAE_NAME, "index": steered_feature, "scale": 15.0}]}}
    steered = api_run(http, "/v1/completions", {**base, **steer})
    at_zero = api_run(http, "/v1/completions", {**base, "steering_vectors": {"features": [
        {"sae": SAE_NAME, "index": steered_feature, "scale": 0.0}]}})
    assert steered["text"] != plain["text"] == at_zero["text"]  # the feature moves the text; at scale 0 it does not

    enter_key(page, USER_KEY)
    expect(page.locator("#sae-info")).to_contain_text("Reads layer 1, post_mlp: 96 features (jumprelu).")
    page.select_option("#module", "")
    fill_run(page, PROMPT, 10, 0.7, 3)
    page.fill("#sae-top-k", str(TOP_K))
    page.fill("#steer-feature", str(steered_feature))
    move_slider(page, "#feature-scale", 5)  # 10 -> 15
    assert page.text_content("#feature-scale-value") == "15"
    page.check("input[name=heat-by][value=feature]")
    page.fill("#heat-feature", str(shown_feature))
    press_run(page)
    page.screenshot(path=str(shots / "features.png"), full_page=True)
    assert page.text_content("#pane-base") == plain["text"]
    assert page.text_content("#pane-steered") == steered["text"]
    assert f"feature {shown_feature}" in page.text_content("#heat-legend")

    for row, choice in [("base", plain), ("steered", steered)]:
        expected = api_features(choice)
        check_features(page, row, expected)
        values = []
        for cell, top in zip(cell_values(page, row), expected):
            hit = [v for i, v in top if i == shown_feature]
            if hit:
                values.append(hit[0])
                assert float(cell) == pytest.approx(hit[0], abs=1e-3)
            else:  # left out of a full top k, the k-th value bounds it; of a shorter one, it is 0
                values.append(0.0)
                if len(top) < TOP_K:
                    assert cell == "0.0000"
                    continue
                bound = re.fullmatch(rf"≤ (\S+) \(not among its top {TOP_K}\)", cell)
                assert bound and float(bound[1]) == pytest.approx(top[-1][1], abs=1e-3)
        if row == "base":
            assert sum(v > 0 for v in values) >= 2  # the chosen feature shows on several tokens
    colours = page.eval_on_selector_all("#heat-base span, #heat-steered span", "cs => cs.map(c => c.style.backgroundColor)")
    assert "rgb(215, 48, 39)" in colours and "rgb(255, 255, 255)" in colours  # the largest full red, 0 white

    page.fill("#steer-feature", str(sae.d_sae))  # out of range: the server's message next to the SAE controls
    press_run_expecting_error(page)
    bad = http.post("/v1/completions", headers=ADMIN, json={**base, "steering_vectors": {"features": [
        {"sae": SAE_NAME, "index": sae.d_sae, "scale": 15.0}]}})
    assert bad.status_code == 400 and page.text_content("#sae-error") == bad.json()["error"]["message"]


def test_a_cross_layer_transcoder_shows_like_an_sae(page, http, sae, tmp_path):
    """A cross-layer transcoder registered from circuit-tracer files: the page names what it is,
    colours the heatmap by one of its layer-1 features (flat index) and lists each token's top
    features over all its layers, as the API captures them; its feature steers the steered run."""
    from transcoder_helpers import WIDTH, random_transcoder, write_circuit_tracer_clt

    name = "pg-clt"
    path = write_circuit_tracer_clt(random_transcoder(layers=3, layer=0, cross_layer=True, seed=41), str(tmp_path / "clt"))
    assert http.post("/v1/saes", json={name: {"path": path}}, headers=ADMIN).status_code == 200
    try:
        base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.7, "seed": 3,
                "capture": [{"stream": "sae_features", "saes": [name], "top_k": TOP_K, "select": "all"}]}
        plain = api_run(http, "/v1/completions", base)
        counts = np.bincount([i for row in api_features(plain, name) for i, _ in row], minlength=3 * WIDTH)
        shown = WIDTH + int(counts[WIDTH:2 * WIDTH].argmax())  # a layer-1 feature, often among the top
        steer = {"steering_vectors": {"features": [{"sae": name, "index": 3, "scale": 10.0}]}}
        steered = api_run(http, "/v1/completions", {**base, **steer})
        assert steered["text"] != plain["text"]
        enter_key(page, USER_KEY)
        page.select_option("#sae", name)
        expect(page.locator("#sae-info")).to_have_text(
            f"Cross-layer transcoder: reads layers 0-2, post_attn; writes mlp_out: {3 * WIDTH} features (jumprelu), "
            f"{WIDTH} a layer (feature i reads layer 0 + floor(i / {WIDTH})).")
        page.select_option("#module", "")
        fill_run(page, PROMPT, 8, 0.7, 3)
        page.fill("#sae-top-k", str(TOP_K))
        page.fill("#steer-feature", "3")
        page.check("input[name=heat-by][value=feature]")
        page.fill("#heat-feature", str(shown))
        press_run(page)
        assert page.text_content("#pane-base") == plain["text"] and page.text_content("#pane-steered") == steered["text"]
        assert f"Transcoder {name}, feature {shown} (layer 1, post_attn)" in page.text_content("#heat-legend")
        expected = api_features(plain, name)
        check_features(page, "base", expected)
        hits = [[v for i, v in top if i == shown] for top in expected]
        assert sum(bool(hit) for hit in hits) >= 2
        for cell, hit in zip(cell_values(page, "base"), hits):
            if hit:
                assert float(cell) == pytest.approx(hit[0], abs=1e-3)
    finally:
        assert http.delete(f"/v1/saes/{name}", headers=ADMIN).status_code == 200


def test_module_and_feature_steer_together_and_the_projection_map_lists_features(page, http, sae):
    """A module and a feature in one steered run equal the API's module ref plus features; in the
    projection heatmap each cell still lists its token's top features."""
    v = torch.randn(64, generator=torch.Generator().manual_seed(31)) * 3
    assert http.post("/v1/steering/modules", json={"pg-both": {"1": v.tolist()}}, headers=ADMIN).status_code == 200
    try:
        enter_key(page, USER_KEY)
        choose_module(page, "pg-both", "layers 1.")
        fill_run(page, PROMPT, 8, 0.7, 5)
        page.fill("#steer-feature", "7")
        press_run(page)
        base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.7, "seed": 5, "capture": [
            {"layers": [1], "hook": "post_mlp", "select": "all", "dtype": "float32"},
            {"stream": "sae_features", "saes": [SAE_NAME], "top_k": 8, "select": "all"}]}
        plain = api_run(http, "/v1/completions", base)
        both = api_run(http, "/v1/completions", {**base, "steering_module_ref": {"name": "pg-both", "scale": 1.0},
                                                 "steering_vectors": {"features": [{"sae": SAE_NAME, "index": 7,
                                                                                    "scale": 10.0}]}})
        module_only = api_run(http, "/v1/completions", {**base, "steering_module_ref": {"name": "pg-both", "scale": 1.0}})
    finally:
        http.delete("/v1/steering/modules/pg-both", headers=ADMIN)
    assert page.text_content("#pane-base") == plain["text"]
    assert page.text_content("#pane-steered") == both["text"] != module_only["text"]
    assert page.text_content("#heat-legend").startswith("Projection on the vector, layer 1, post_mlp.")
    check_features(page, "steered", api_features(both))


def pattern_weights(page, row: str) -> list[float | None]:
    """Each cell's weight from the hovered query (None: not one of its keys)."""
    return [None if w is None else float(w) for w in
            page.eval_on_selector_all(f"#pattern-{row} span", "cells => cells.map(c => c.dataset.weight ?? null)")]


def test_attention_view_equals_the_offline_patterns(page, offline, sae, shots):
    """Layer 2's patterns (after the feature steered layer 1): hovering a token colours its keys by
    the head's weights, which equal the offline capture of that row, sum to 1 and end at the query;
    another head repaints from the same capture; a head the layer lacks is named."""
    prompt, steer_index = "Hello world! How are you", 11
    enter_key(page, USER_KEY)
    page.select_option("#module", "")
    fill_run(page, prompt, 6, 0, 0)
    page.fill("#steer-feature", str(steer_index))
    assert page.input_value("#module") == "" and page.input_value("#feature-scale") == "10"
    page.check("#pattern-on")
    page.select_option("#pattern-layer", "2")
    page.fill("#pattern-head", "1")
    page.check("input[name=heat-by][value=feature]")
    press_run(page)
    spec = CaptureSpec(stream="attention_patterns", layers=[2], select="all")
    feature = steering_from_json({"features": [{"sae": SAE_NAME, "index": steer_index, "scale": 10.0}]})
    outs = [offline.generate(prompt, SamplingParams(max_tokens=6, temperature=0, capture=spec, steering_vectors=s),
                             use_tqdm=False)[0] for s in (None, feature)]
    assert page.text_content("#pane-base") == outs[0].outputs[0].text
    assert page.text_content("#pane-steered") == outs[1].outputs[0].text

    queries = {"base": 4, "steered": 7}
    for (row, q), out in zip(queries.items(), outs):
        patterns = out.captures["attention_patterns"][2]
        assert len(patterns) == page.locator(f"#pattern-{row} span").count() > q
        for head in (1, 3):
            page.fill("#pattern-head", str(head))
            page.hover(f"#pattern-{row} span >> nth={q}")
            expect(page.locator(f"#pattern-{row} span.query")).to_have_count(1)
            weights = pattern_weights(page, row)
            want = patterns.rows[q][head].double().numpy()
            assert weights[q + 1:] == [None] * (len(weights) - q - 1)  # later tokens are not keys
            np.testing.assert_allclose(weights[:q + 1], want, rtol=0, atol=1e-6)
            assert sum(weights[:q + 1]) == pytest.approx(1.0, abs=1e-5)
            assert re.search(rf"head {head} \(of 4\)", page.text_content("#pattern-legend"))
    base_row, steered_row = (outs[i].captures["attention_patterns"][2].rows[7][3] for i in range(2))
    assert (base_row - steered_row).abs().max() > 1e-3  # the steering reached layer 2's attention
    page.screenshot(path=str(shots / "patterns.png"), full_page=True)

    page.fill("#pattern-head", "4")
    expect(page.locator("#pattern-error")).to_have_text("Layer 2 has heads 0 to 3.")
