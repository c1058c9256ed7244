"""``evaluate`` against HF with the vector added by hooks (tiny float32 model): the logit
difference of the two answers, p(matching), the wrong-way fraction and the KL on neutral text;
the report's table and plot; ``steerable vectors train|eval`` end to end."""

import json

import numpy as np
import pytest
import torch
from conftest import hf_model
from hf_oracle import HFSteered, add_edit

from steerable import LLM
from steerable.entrypoints.cli import main
from steerable.selection import SelectSpec
from steerable.vectors import ABItem, ControlVector, evaluate

ITEMS = [{"prompt": "The quick brown", "matching": " fox", "other": " dog"},
         {"prompt": "Hello world! How are", "matching": " you", "other": " today"},
         {"question": "Pick one.\n(A) fox\n(B) dog", "matching": "B"},
         {"question": "Pick again.\n(A) blocks\n(B) keys", "answer_matching_behavior": "(A)"}]
NEUTRAL = ["Paged attention stores keys", "Numbers like 12345"]
SCALES = [-1.0, 0.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def cv():
    g = torch.Generator().manual_seed(3)
    return ControlVector({layer: torch.randn(64, generator=g) * 2.0 for layer in (1, 2)})


def hf_reference(model_dirs, llm, cv, positions):
    """(logit differences [items, scales], KL per scale) from HF with the vector hooked in."""
    hf = hf_model(model_dirs["llama"])
    tok = llm.get_tokenizer()
    select = SelectSpec(prompt_positions=[-1], generation="all") if positions == "answer" else None
    items = [ABItem.parse(item).tokens(tok, chat=True) for item in ITEMS]
    neutral = [tok(text).input_ids for text in NEUTRAL]

    def last_logprobs(ids, scale):
        edits = [("post_mlp", layer, add_edit(v * scale), select) for layer, v in cv.directions.items()]
        return torch.log_softmax(HFSteered(hf, edits).forward(torch.tensor([ids]), len(ids))[-1].double(), -1)

    diffs = np.array([[float(lp[m] - lp[o]) for s in SCALES for lp in [last_logprobs(ids, s)]]
                      for ids, m, o in items])
    base = [last_logprobs(ids, 0.0) for ids in neutral]
    kls = [np.mean([float((lp.exp() * (lp - b)).sum()) for lp, b in zip([last_logprobs(ids, s) for ids in neutral],
                                                                       base)]) for s in SCALES]
    return diffs, kls


@pytest.mark.parametrize("positions", ["all", "answer"])
def test_metrics_equal_hf_with_hooks(llm, model_dirs, cv, positions):
    report = evaluate(llm, cv, ITEMS, scales=SCALES, neutral=NEUTRAL, positions=positions)
    diffs, kls = hf_reference(model_dirs, llm, cv, positions)
    np.testing.assert_allclose(report.logit_diffs, diffs, atol=2e-4)
    assert np.abs(diffs[:, 3] - diffs[:, 1]).max() > 0.5  # the vector really moves the answers
    for k, row in enumerate(report.rows):
        assert row.scale == SCALES[k]
        assert row.logit_diff == pytest.approx(diffs[:, k].mean(), abs=2e-4)
        assert row.p_match == pytest.approx(np.mean(1 / (1 + np.exp(-diffs[:, k]))), abs=1e-4)
        moved = (diffs[:, k] - diffs[:, 1]) * np.sign(SCALES[k])
        assert row.wrong_way == pytest.approx(float((moved < -1e-3).mean()))
        assert row.kl == pytest.approx(kls[k], abs=1e-4)
    assert report.rows[1].kl == 0.0 and report.rows[3].kl > 1e-3
    x = np.array(SCALES) - np.mean(SCALES)
    np.testing.assert_allclose(report.slopes, (diffs - diffs.mean(1, keepdims=True)) @ x / (x @ x), atol=1e-3)


def test_report_table_and_plot(llm, cv, tmp_path):
    report = evaluate(llm, cv, ITEMS[:2], scales=[-1, 0, 1], neutral=[])
    table = report.to_markdown()
    assert table.splitlines()[0].startswith("| scale | p(matching) |") and "n/a" in table
    assert len(table.splitlines()) == 2 + 3 + 2
    report.plot(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs, field", [
    (dict(items=[]), "items"), (dict(items=[{"question": "q", "matching": "C"}]), "matching"),
    (dict(items=[{"prompt": "p", "matching": " a", "other": " a"}]), "different tokens"),
    (dict(scales=[float("nan")]), "scales"), (dict(positions="some"), "positions"),
    (dict(relative=True), "relative"),
])
def test_bad_arguments(llm, cv, kwargs, field):
    args = {"items": ITEMS, "scales": SCALES, "neutral": [], **kwargs}
    with pytest.raises(ValueError, match=field):
        evaluate(llm, cv, args.pop("items"), **args)
    assert not llm.engine.requests


def test_cli_train_then_eval(model_dirs, tmp_path, capsys):
    pairs = [("The quick brown fox jumps", "The lazy dog sleeps"), ("Hello world!", "Goodbye world."),
             ("Steering vectors", "Capture streams"), ("Numbers like 12345", "Letters like abcde")]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"positive": p, "negative": n}) + "\n" for p, n in pairs))
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    engine = ["--model", model_dirs["llama"], "--device", "cpu", "--kv-cache-tokens", "2048"]
    assert main(["vectors", "train", *engine, "--pairs", str(tmp_path / "pairs.jsonl"), "--layers", "1-2",
                 "--method", "pca_diff", "--out", str(tmp_path / "v.gguf")]) == 0
    cv = ControlVector.load(tmp_path / "v.gguf")
    assert cv.layers == [1, 2] and float(cv.directions[1].norm()) == pytest.approx(1.0, abs=1e-5)
    assert main(["vectors", "eval", *engine, "--vector", str(tmp_path / "v.gguf"), "--items",
                 str(tmp_path / "items.jsonl"), "--scales", "-2,0,2", "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "| -2 |" in out and "| 2 |" in out and (tmp_path / "s.png").exists()
    assert main(["vectors", "eval", *engine, "--vector", str(tmp_path / "v.gguf"), "--items",
                 str(tmp_path / "items.jsonl"), "--relative"]) == 2
    assert "relative: no mean residual norm" in capsys.readouterr().err
    assert main(["vectors", "train", "--pairs", str(tmp_path / "items.jsonl"), "--out", "v.gguf"]) == 2
    assert "expected {'positive': str, 'negative': str}" in capsys.readouterr().err
