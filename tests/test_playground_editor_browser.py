"""The playground's module editor in a real browser (see test_playground_browser.py for the set-up):
each intervention type inserts a template sized for the served model, a written module registers
through the admin route and steers as the API does, the server's message for a bad one shows next
to the editor, and a user key cannot write modules."""

from __future__ import annotations

import json

import pytest
from browser_harness import browser, enter_key, expect, page, shots  # noqa: F401
from server_harness import ADMIN, ADMIN_KEY, SERVED_NAME, USER, USER_KEY, assert_nothing_held

from steerable.steering.wire import steering_from_json

pytestmark = pytest.mark.browser
TYPES = ["add", "clamp", "feature", "lowrank", "affine", "when", "router_bias"]


def test_every_type_inserts_a_template_and_a_written_module_registers(page, http, shots):
    enter_key(page, ADMIN_KEY)
    assert page.eval_on_selector_all("#editor-item option", "os => os.map(o => o.value)") == TYPES
    for kind in TYPES:
        page.select_option("#editor-item", kind)
        page.click("#editor-insert")
    spec = json.loads(page.input_value("#editor-json"))
    assert [item["type"] for item in spec["interventions"]] == TYPES
    lowrank = spec["interventions"][3]
    assert lowrank["R"]["shape"] == [4, 64] and lowrank["layer"] == 1  # the tiny model: width 64, 3 layers
    # Keep the items this dense model with no SAE serves, with a LoReFT that changes something.
    spec["interventions"] = [item for item in spec["interventions"] if item["type"] in ("lowrank", "when", "affine")]
    spec["interventions"][0]["W"] = {**spec["interventions"][0]["W"], "data": _ones_base64(4 * 64)}
    spec["interventions"][0]["b"] = [8.0, -8.0, 8.0, -8.0]
    page.fill("#editor-json", json.dumps(spec))
    page.fill("#editor-name", "pg-written")
    page.click("#editor-register")
    try:
        expect(page.locator("#module")).to_have_value("pg-written")
        expect(page.locator("#module-info")).to_contain_text("steers as registered")
        page.screenshot(path=str(shots / "editor.png"), full_page=True)
        body = {"model": SERVED_NAME, "prompt": "Hello world", "max_tokens": 6, "temperature": 0}
        steered = http.post("/v1/completions", json={**body, "steering_module_ref": "pg-written"}, headers=USER)
        inline = http.post("/v1/completions", json={**body, "steering_vectors": spec}, headers=USER)
        plain = http.post("/v1/completions", json=body, headers=USER)
        assert steered.json()["choices"][0]["text"] == inline.json()["choices"][0]["text"]
        assert steered.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]
        steering_from_json(http.get("/v1/steering/modules/pg-written", headers=USER).json()["spec"])
    finally:
        http.delete("/v1/steering/modules/pg-written", headers=ADMIN)
    assert_nothing_held(http)


def _ones_base64(count: int) -> str:
    import base64

    import numpy as np

    return base64.b64encode(np.full(count, 0.5, dtype="<f4").tobytes()).decode()


def test_a_bad_module_shows_the_server_message_next_to_the_editor(page, http, shots):
    enter_key(page, ADMIN_KEY)
    page.select_option("#editor-item", "router_bias")
    page.click("#editor-insert")
    page.fill("#editor-name", "pg-bad")
    page.click("#editor-register")
    expect(page.locator("#editor-error")).to_contain_text("has no router")
    page.screenshot(path=str(shots / "editor-error.png"), full_page=True)
    page.fill("#editor-json", "{not json")
    page.click("#editor-register")
    expect(page.locator("#editor-error")).to_contain_text("not a JSON object")
    assert "pg-bad" not in http.get("/v1/steering/modules", headers=USER).json()["modules"]


def test_a_user_key_cannot_write_modules(page):
    enter_key(page, USER_KEY)
    for control in ("#editor-item", "#editor-insert", "#editor-json", "#editor-register"):
        expect(page.locator(control)).to_be_disabled()
    expect(page.locator("#admin-reason")).to_contain_text("writing modules")
