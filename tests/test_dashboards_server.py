"""Feature dashboards end to end: ``steerable dashboards`` (the CLI) writes a directory equal to the
in-process computation; ``steerable serve --sae ... --dashboards DIR`` serves each feature at
``GET /v1/saes/{name}/features/{i}`` (404 where none was computed); and the playground's feature
page, in headless Chromium, shows the top example's tokens coloured by activation, the histogram as
bars, the logits, and steers the prompt by the feature (the output changes). One server of its own
(``server`` here overrides the shared one, so the browser harness's ``page`` opens this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from browser_harness import browser, enter_key, expect, page, shots  # noqa: F401
from server_harness import ROOT, USER, USER_KEY, serve_test_model
from test_sae_registry import random_sae, save_saelens

from steerable.entrypoints.cli.common import CliError
from steerable.entrypoints.cli.serve import attach_dashboards
from steerable.sae.dashboards import FeatureDashboards, feature_dashboards

ARGS = dict(n_top=5, context=(4, 2), quantiles=4, n_quantile=2, bins=10, n_logits=6)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Steering vectors shift the residual stream.",
         "Paged attention stores keys and values in fixed-size blocks.", "Hello world! How are you today?",
         "Numbers like 12345 and 67890 appear in text too.", "Capture every hidden state and label it.",
         "Continuous batching mixes prefill and decode tokens in one step.", "a b c d e f g"]


@pytest.fixture(scope="module")
def made(model_dirs, tmp_path_factory):
    """Two SAEs as SAELens folders, the corpus as JSON lines, and res1's dashboards by the CLI."""
    root = tmp_path_factory.mktemp("dashboards")
    res1 = save_saelens(random_sae(layer=1, hook="post_mlp", apply_b_dec_to_input=True, seed=4), root / "res1")
    other = save_saelens(random_sae(layer=1, hook="post_mlp", seed=5), root / "other")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = root / "dash"
    cmd = [sys.executable, "-m", "steerable.entrypoints.cli", "dashboards", model_dirs["qwen3"], "--sae", res1,
           "--input", str(corpus), "--out", str(out), "--device", "cpu", "--kv-cache-tokens", "8192",
           "--shard-size", "3", "--n-top", "5", "--context", "4,2", "--quantiles", "4", "--n-quantile", "2",
           "--bins", "10", "--n-logits", "6", "--batch-features", "40", "--model-id", "tiny-qwen3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert f"{len(TEXTS)} texts" in done.stdout and "dashboards of 96 features" in done.stdout
    return {"res1": res1, "other": other, "out": out}


@pytest.fixture(scope="module")
def expected(offline, made):
    """The same dashboards computed in this process, on the served model."""
    from steerable import SAE

    offline.register_sae("res1", SAE.load(made["res1"]))
    try:
        return feature_dashboards(offline, TEXTS, "res1", **ARGS)
    finally:
        offline.unregister_sae("res1")


@pytest.fixture(scope="module")
def server(model_dirs, made, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("dashboards_server") / "server.log")
    flags = ["--sae", f"res1={made['res1']}", "--sae", f"other={made['other']}", "--dashboards", str(made["out"])]
    with serve_test_model(model_dirs["qwen3"], log, extra_args=flags) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_cli_writes_what_the_library_computes(made, expected):
    on_disk = FeatureDashboards.load(made["out"])
    assert on_disk.features == expected.features == list(range(96)) and on_disk.dead == expected.dead
    for f in expected.features:
        assert json.dumps(on_disk[f].to_dict()) == json.dumps(expected[f].to_dict())
    batches = sorted(p.name for p in made["out"].glob("batch-*.json"))
    assert batches == ["batch-0.json", "batch-1.json", "batch-2.json"]  # 40 features each
    first = json.loads((made["out"] / "batch-0.json").read_text())
    assert first["model_id"] == "tiny-qwen3" and len(first["features"]) == 40


def test_route_serves_each_computed_feature(api, expected):
    live = max(expected.features, key=lambda f: expected[f].count)
    for f in (live, *expected.dead[:1]):
        r = api.get(f"/v1/saes/res1/features/{f}", headers=USER)
        assert r.status_code == 200, r.text
        assert r.json() == {"sae": "res1", **json.loads(json.dumps(expected[f].to_dict()))}
    body = api.get(f"/v1/saes/res1/features/{live}", headers=USER).json()
    assert body["top"] and body["top"][0]["max"] == body["max"] > 0 and len(body["histogram"]["edges"]) == 11
    summary = api.get("/v1/saes/res1/features", headers=USER).json()
    assert (summary["tokens"], summary["texts"], summary["d_sae"]) == (expected.tokens, len(TEXTS), 96)
    for path, param in [("/v1/saes/other/features/3", "name"), ("/v1/saes/nope/features/3", "name"),
                        ("/v1/saes/res1/features/96", "index"), ("/v1/saes/other/features", "name")]:
        r = api.get(path, headers=USER)
        assert r.status_code == 404 and r.json()["error"]["param"] == param, (path, r.text)
    assert api.get(f"/v1/saes/res1/features/{live}").status_code == 401


def test_dashboards_of_another_sae_are_refused(made):
    import torch

    from steerable import SAE

    dash = FeatureDashboards.load(made["out"])
    assert attach_dashboards({"x": SAE.load(made["res1"])}, [("d", dash)], torch.float32) == {"x": dash}
    with pytest.raises(CliError, match="--dashboards d: sae_sha256 .* matches no SAE given with --sae"):
        attach_dashboards({"other": SAE.load(made["other"])}, [("d", dash)], torch.float32)


@pytest.mark.browser
def test_feature_page(page, expected, shots):
    enter_key(page, USER_KEY)
    page.select_option("#sae", "res1")
    live = max(expected.features, key=lambda f: expected[f].count)
    want = expected[live]
    page.fill("#dash-feature", str(live))
    page.click("#open-dashboard")
    expect(page.locator("#feature-title")).to_have_text(f"Feature {live} of SAE res1")
    expect(page.locator("#feature-top .example")).to_have_count(len(want.top))
    first = page.locator("#feature-top .example").first.locator("span")
    expect(first).to_have_count(len(want.top[0].tokens))
    colours = first.evaluate_all("spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    peak = want.top[0].offset
    assert colours[peak] == "rgb(215, 48, 39)"  # full red: the feature's max
    for colour, value in zip(colours, want.top[0].activations):  # white at 0, red at the max
        t = min(1, max(0, value / want.max))
        assert colour == "rgb({}, {}, {})".format(*(round(255 + (c - 255) * t) for c in (215, 48, 39)))
    assert len(set(colours)) > 2
    used = max(j + 1 for j, c in enumerate(want.histogram.counts) if c)
    heights = page.locator("#feature-hist rect").evaluate_all("bars => bars.map(b => Number(b.getAttribute('height')))")
    assert len(heights) == used
    tallest, scale = max(want.histogram.counts), max(heights)
    assert all(abs(h - c / tallest * scale) <= 0.1 for h, c in zip(heights, want.histogram.counts))
    expect(page.locator("#feature-pos tr")).to_have_count(6)
    page.locator("#feature-page").screenshot(path=str(shots / "feature-page.png"))
    expect(page.locator("#feature-pos tr").first.locator("td").first).to_have_text(
        json.dumps(want.top_logits[0].token_str, ensure_ascii=False))
    # Steer the prompt by the feature: the steered pane differs from the unsteered one.
    page.fill("#prompt", "The quick brown fox")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    page.click("#steer-by-feature")
    expect(page.locator("#run-status")).to_have_text("Done.", timeout=60_000)
    base, steered = page.text_content("#pane-base"), page.text_content("#pane-steered")
    assert base and steered and base != steered
    # The token hover list: a feature clicked there opens its page.
    page.locator("#heat-steered span").first.focus()
    button = page.locator("#heat-features button").first
    index = int(button.text_content().split()[0][1:])
    button.click()
    expect(page.locator("#feature-title")).to_have_text(f"Feature {index} of SAE res1")
    expect(page.locator("#feature-stats")).not_to_be_empty()
