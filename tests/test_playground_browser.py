"""The playground in a real browser (issue 14): headless Chromium (Debian's ``chromium`` package,
driven by ``playwright`` through its ``executable_path``; nothing downloads a browser) against the
shared test server on loopback. What the page shows must equal what the API returns for the same
parameters: both completions, and every heatmap cell's projection. One browser for the module
(browser_harness); screenshots go to a temp folder named at the start. Select with ``-m browser``."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from browser_harness import api_run, browser, choose_module, enter_key, expect, page, run_page, shots  # noqa: F401
from server_harness import ADMIN, ADMIN_KEY, USER, USER_KEY, assert_nothing_held

from steerable.capture import deserialize_captured
from steerable.vectors import ControlVector

pytestmark = pytest.mark.browser

POSITIVES = ["I love this place.", "What a wonderful day.", "The food was delicious."]
NEGATIVES = ["I hate this place.", "What a terrible day.", "The food was disgusting."]
ITEMS = [{"prompt": "The quick brown", "matching": " fox", "other": " dog"},
         {"question": "Pick one.\n(A) fox\n(B) dog", "matching": "B"}]


def heat_cells(page, row: str) -> list[tuple[str, float]]:
    """(token text, value) of each heatmap cell, read from its hover text."""
    out = []
    for title in page.eval_on_selector_all(f"#heat-{row} span", "cells => cells.map(c => c.title)"):
        text, _, value = title.rpartition(": ")
        out.append((json.loads(text.rsplit(" at position ", 1)[0]), float(value)))
    return out


def check_heatmap(page, http, choice: dict, row: str, direction: torch.Tensor) -> None:
    tensors, metas = deserialize_captured(choice["captures"]["hidden_states"])
    (layer,) = tensors
    expected = (tensors[layer].double() @ direction.double() / direction.double().norm()).numpy()
    cells = heat_cells(page, row)
    assert len(cells) == len(expected) > 0
    np.testing.assert_allclose([value for _, value in cells], expected, rtol=0, atol=1e-3)
    texts = [http.post("/detokenize", json={"tokens": [t]}, headers=USER).json()["prompt"]
             for t in metas[layer].token_ids.tolist()]
    assert [text for text, _ in cells] == texts


def test_steered_and_unsteered_panes_and_heatmap_equal_the_api(page, http, tmp_path, shots):
    """Upload a control vector, type a prompt, set the scale with the keyboard, run: each pane
    equals the API's completion for the same parameters and each cell the API capture's projection."""
    g = torch.Generator().manual_seed(21)
    cv = ControlVector({1: torch.randn(64, generator=g) * 3, 2: torch.randn(64, generator=g) * 3})
    cv.save(tmp_path / "pg-upload.gguf")
    enter_key(page, ADMIN_KEY)
    page.set_input_files("#upload-file", str(tmp_path / "pg-upload.gguf"))
    assert page.input_value("#upload-name") == "pg-upload"
    page.focus("#upload")
    page.keyboard.press("Enter")
    expect(page.locator("#module")).to_have_value("pg-upload")
    try:
        expect(page.locator("#module-info")).to_contain_text("layers 1, 2")
        page.select_option("#heat-layer", "2")
        for selector, value in [("#max-tokens", "12"), ("#temperature", "0.8"), ("#seed", "7")]:
            page.fill(selector, value)
        run_page(page, "The quick brown fox", scale_steps=5)
        page.screenshot(path=str(shots / "completion.png"), full_page=True)
        base = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.8, "seed": 7,
                "capture": {"layers": [2], "hook": "post_mlp", "select": "all", "dtype": "float32"}}
        plain = api_run(http, "/v1/completions", base)
        steered = api_run(http, "/v1/completions",
                          {**base, "steering_module_ref": {"name": "pg-upload", "scale": 1.5}})
    finally:
        http.delete("/v1/steering/modules/pg-upload", headers=ADMIN)
    assert page.text_content("#pane-base") == plain["text"]
    assert page.text_content("#pane-steered") == steered["text"] != plain["text"]
    check_heatmap(page, http, plain, "base", cv.directions[2])
    check_heatmap(page, http, steered, "steered", cv.directions[2])


def test_chat_mode_equals_the_chat_api(page, http, shots):
    v = torch.randn(64, generator=torch.Generator().manual_seed(22)) * 3
    assert http.post("/v1/steering/modules", json={"pg-chat": {"post_attn": {"1": v.tolist()}}},
                     headers=ADMIN).status_code == 200
    try:
        enter_key(page, USER_KEY)
        choose_module(page, "pg-chat", "Adds at post_attn, layers 1.")
        assert page.input_value("#heat-hook") == "post_attn"
        page.check("input[name=mode][value=chat]")
        page.fill("#system", "Answer briefly.")
        page.fill("#max-tokens", "10")
        run_page(page, "Hello world! How are you today?", scale_steps=-15)
        page.screenshot(path=str(shots / "chat.png"), full_page=True)
        base = {"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Hello world! How are you today?"}],
                "max_tokens": 10, "temperature": 0.7, "seed": 0,
                "capture": {"layers": [1], "hook": "post_attn", "select": "all", "dtype": "float32"}}
        plain = api_run(http, "/v1/chat/completions", base)
        steered = api_run(http, "/v1/chat/completions",
                          {**base, "steering_module_ref": {"name": "pg-chat", "scale": -0.5}})
    finally:
        http.delete("/v1/steering/modules/pg-chat", headers=ADMIN)
    assert page.text_content("#pane-base") == plain["message"]["content"]
    assert page.text_content("#pane-steered") == steered["message"]["content"]
    check_heatmap(page, http, steered, "steered", v)


def test_steering_at_other_layers_and_hook_equals_the_inline_api(page, http, shots):
    """The steer-at controls move a module's additions: a layer it lacks is refused next to them
    before anything runs; a subset of its layers at another hook runs inline and equals the API."""
    g = torch.Generator().manual_seed(24)
    v1, v2 = torch.randn(64, generator=g) * 3, torch.randn(64, generator=g) * 3
    d = torch.randn(64, generator=g)
    modules = {"pg-place": {"post_mlp": {"1": v1.tolist(), "2": v2.tolist()}},
               "pg-clamped": {"vectors": {"1": v1.tolist()}, "clamps": [{"layer": 2, "direction": d.tolist(), "max": 0.0}]}}
    assert http.post("/v1/steering/modules", json=modules, headers=ADMIN).status_code == 200
    try:
        enter_key(page, USER_KEY)
        choose_module(page, "pg-clamped", "It steers as registered")
        assert page.is_disabled("#steer-layers") and page.is_disabled("#steer-hook")
        choose_module(page, "pg-place", "layers 1, 2.")
        assert page.is_enabled("#steer-layers") and page.input_value("#steer-layers") == "1, 2"
        assert page.input_value("#steer-hook") == "post_mlp"
        page.fill("#steer-layers", "2, 5")
        page.click("#run")
        expect(page.locator("#steer-error")).to_have_text("The module adds nothing at layer 5; it adds at 1, 2.")
        assert page.text_content("#run-status") == "" and page.text_content("#pane-steered") == ""
        page.fill("#steer-layers", "2")
        page.select_option("#steer-hook", "post_attn")
        page.select_option("#heat-layer", "2")
        page.fill("#max-tokens", "12")
        run_page(page, "The quick brown fox", scale_steps=5)
        assert page.text_content("#steer-error") == ""
        page.screenshot(path=str(shots / "placement.png"), full_page=True)
        base = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.7, "seed": 0,
                "capture": {"layers": [2], "hook": "post_mlp", "select": "all", "dtype": "float32"}}
        moved = api_run(http, "/v1/completions",
                        {**base, "steering_vectors": {"post_attn": {"2": {"vector": v2.tolist(), "scale": 1.5}}}})
        as_registered = api_run(http, "/v1/completions",
                                {**base, "steering_module_ref": {"name": "pg-place", "scale": 1.5}})
    finally:
        http.delete("/v1/steering/modules/pg-place", headers=ADMIN)
        http.delete("/v1/steering/modules/pg-clamped", headers=ADMIN)
    assert page.text_content("#pane-steered") == moved["text"] != as_registered["text"]
    check_heatmap(page, http, moved, "steered", v2)


def test_stop_aborts_both_runs_and_the_server_keeps_serving(page, http):
    v = torch.randn(64, generator=torch.Generator().manual_seed(23))
    assert http.post("/v1/steering/modules", json={"pg-stop": {"1": v.tolist()}}, headers=ADMIN).status_code == 200
    try:
        enter_key(page, USER_KEY)
        choose_module(page, "pg-stop", "layers 1.")
        page.fill("#max-tokens", "400")
        page.fill("#prompt", "Hello")
        page.click("#run")
        expect(page.locator("#pane-steered")).not_to_be_empty()
        page.click("#stop")
        expect(page.locator("#run-status")).to_have_text("Stopped.")
        assert page.is_enabled("#run") and page.is_disabled("#stop")
        assert_nothing_held(http)
        page.fill("#max-tokens", "4")
        run_page(page, "", scale_steps=0)  # and the next run completes
    finally:
        http.delete("/v1/steering/modules/pg-stop", headers=ADMIN)


def test_user_key_sees_admin_controls_disabled(page, shots):
    expect(page.locator("#key-status")).to_have_text("This server needs an API key.")  # after the page's first call
    assert page.text_content("#api-key-error") == ""
    enter_key(page, USER_KEY)
    assert page.text_content("#key-status").startswith("User key")
    for control in ("#upload-file", "#upload", "#positives", "#train"):
        assert page.is_disabled(control), control
    assert page.is_enabled("#run") and page.is_enabled("#sweep")
    assert page.is_visible("#admin-reason") and "need the admin key" in page.text_content("#admin-reason")
    page.screenshot(path=str(shots / "user-key.png"), full_page=True)
    # The key lives in sessionStorage only: not in the page, not in the URL.
    assert page.evaluate("sessionStorage.getItem('steerable.apiKey')") == USER_KEY
    assert USER_KEY not in page.content() and USER_KEY not in page.url
    unlabelled = page.evaluate("""[...document.querySelectorAll('input, select, textarea, button')]
        .filter(el => !(el.labels?.length || el.getAttribute('aria-label') || (el.tagName === 'BUTTON' && el.textContent.trim())))
        .map(el => el.id)""")
    assert unlabelled == []


def test_bad_upload_shows_the_server_message_next_to_the_upload(page, http, tmp_path, shots):
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"GGUF but not really a control vector")
    enter_key(page, ADMIN_KEY)
    page.set_input_files("#upload-file", str(junk))
    page.click("#upload")
    expect(page.locator("#upload-error")).not_to_be_empty()
    page.screenshot(path=str(shots / "bad-upload.png"), full_page=True)
    r = http.post("/v1/steering/modules", headers=ADMIN,
                  json={"broken": {"control_vector": base64.b64encode(junk.read_bytes()).decode(), "scale": 1}})
    assert r.status_code == 400
    assert page.text_content("#upload-error") == r.json()["error"]["message"]
    assert "upload-error" in page.get_attribute("#upload-file", "aria-describedby")
    assert page.eval_on_selector("#upload-error", "el => el.closest('fieldset').id") == "upload-fieldset"
    assert "broken" not in http.get("/v1/steering/modules", headers=USER).json()["modules"]


def test_train_in_place_then_sweep_plots_the_report(page, http, shots):
    enter_key(page, ADMIN_KEY)
    page.fill("#positives", "\n".join(POSITIVES))
    page.fill("#negatives", "\n".join(NEGATIVES))
    page.fill("#train-layers", "1-2")
    page.fill("#train-name", "pg-trained")
    page.click("#train")
    expect(page.locator("#module")).to_have_value("pg-trained", timeout=30_000)
    try:
        expect(page.locator("#module-info")).to_contain_text("layers 1, 2")  # filled after the value is set
        page.fill("#items", '{"prompt": "x"}')
        page.click("#sweep")
        expect(page.locator("#items-error")).not_to_be_empty()
        bad = http.post("/v1/vectors/evaluate", json={"module": "pg-trained", "items": [{"prompt": "x"}]}, headers=USER)
        assert page.text_content("#items-error") == bad.json()["error"]["message"]

        page.fill("#items", "\n".join(json.dumps(item) for item in ITEMS))
        page.fill("#scales", "-1, 0, 1")
        page.click("#sweep")
        expect(page.locator("#sweep-table tbody tr")).to_have_count(3, timeout=60_000)
        page.screenshot(path=str(shots / "sweep.png"), full_page=True)
        report = http.post("/v1/vectors/evaluate", json={"module": "pg-trained", "items": ITEMS, "scales": [-1, 0, 1]},
                           headers=USER).json()
    finally:
        http.delete("/v1/steering/modules/pg-trained", headers=ADMIN)
    table = page.eval_on_selector_all("#sweep-table tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    points = page.eval_on_selector_all("#sweep-plot circle title", "titles => titles.map(t => t.textContent)")
    assert len(table) == len(points) == 3
    for cells, point, row in zip(table, points, report["rows"]):
        assert float(cells[0]) == row["scale"]
        np.testing.assert_allclose([float(c) for c in cells[1:]], [row["p_match"], row["logit_diff"], row["wrong_way"],
                                                                   row["kl"]], rtol=0, atol=1e-3)
        assert float(point.rpartition(" ")[2]) == pytest.approx(row["p_match"], abs=1e-3)
