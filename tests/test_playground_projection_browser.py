"""The playground's steering method (issue 50) in headless Chromium against the shared test server:
a module's vector added, or used as the direction of a projection scaling (ORTHOGONAL_DECOMP,
``Clamp(factor=scale)``) or a projection cap (PROJECTION_CAP, ``Clamp(max=scale)``) at each of its
layers; the steered pane equals the API's completion with those clamps inline. Select with ``-m browser``."""

from __future__ import annotations

import pytest
import torch
from browser_harness import api_run, browser, choose_module, enter_key, expect, page, run_page, shots  # noqa: F401
from server_harness import ADMIN, USER_KEY

pytestmark = pytest.mark.browser

PROMPT = "The quick brown fox"


@pytest.mark.parametrize("method, steps, form", [("decompose", -25, "factor"), ("cap", -90, "max")])
def test_projection_methods_equal_the_inline_clamps(page, http, shots, method, steps, form):
    g = torch.Generator().manual_seed(31)
    v1, v2 = torch.randn(64, generator=g) * 3, torch.randn(64, generator=g) * 3
    d = torch.randn(64, generator=g)
    modules = {"pg-proj": {"post_mlp": {"1": v1.tolist(), "2": v2.tolist()}},
               "pg-proj-clamped": {"clamps": [{"layer": 2, "direction": d.tolist(), "max": 0.0}]}}
    assert http.post("/v1/steering/modules", json=modules, headers=ADMIN).status_code == 200
    try:
        enter_key(page, USER_KEY)
        choose_module(page, "pg-proj-clamped", "It steers as registered")
        assert page.is_disabled("#steer-method") and page.input_value("#steer-method") == "add"
        choose_module(page, "pg-proj", "layers 1, 2.")
        page.select_option("#steer-method", method)
        expect(page.locator("#steer-method-info")).to_contain_text(
            "ORTHOGONAL_DECOMP" if method == "decompose" else "PROJECTION_CAP")
        page.fill("#max-tokens", "12")
        run_page(page, PROMPT, scale_steps=steps)
        page.screenshot(path=str(shots / f"method-{method}.png"), full_page=True)
        scale = max(-8.0, round(1 + steps * 0.1, 6))  # the slider stops at -8
        base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.7, "seed": 0}
        clamps = [{"type": "clamp", "layer": layer, "direction": v.tolist(), "hook": "post_mlp", form: scale}
                  for layer, v in ((1, v1), (2, v2))]
        want = api_run(http, "/v1/completions", {**base, "steering_vectors": {"interventions": clamps}})
        plain = api_run(http, "/v1/completions", base)
    finally:
        http.delete("/v1/steering/modules/pg-proj", headers=ADMIN)
        http.delete("/v1/steering/modules/pg-proj-clamped", headers=ADMIN)
    assert page.text_content("#pane-base") == plain["text"]
    assert page.text_content("#pane-steered") == want["text"] != plain["text"]
