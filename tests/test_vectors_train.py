"""``steerable.vectors.train`` against numpy on HF ``output_hidden_states`` of the same prompts
(tiny float32 model), for every method, token choice and a second hook."""

import numpy as np
import pytest
import torch
from conftest import hf_model

from steerable import LLM
from steerable.vectors import train

POSITIVES = ["The quick brown fox jumps", "Hello world! How are you today?", "Steering vectors shift the residual",
             "Numbers like 12345 appear", "Paged attention stores keys", "Continuous batching mixes prefill",
             "Capture every hidden state", "The lazy dog sleeps"]
NEGATIVES = ["The lazy dog jumps", "Hello world! I am fine, thank you.", "Capture vectors read the residual",
             "Numbers like 67890 appear in text", "Paged blocks store values", "Continuous decode mixes tokens",
             "Label every hidden state", "The quick fox sleeps"]


@pytest.fixture(scope="module")
def llm(capture_dirs):
    return LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def hidden(capture_dirs, llm):
    """HF ``hidden_states`` per prompt: (positives, negatives), each a list of [layers+1, T, H]."""
    model = hf_model(capture_dirs["llama"])
    tok = llm.get_tokenizer()

    def states(text):
        with torch.no_grad():
            out = model(torch.tensor([tok(text).input_ids]), output_hidden_states=True)
        return torch.stack(out.hidden_states)[:, 0].double().numpy()

    return [states(t) for t in POSITIVES], [states(t) for t in NEGATIVES]


def rows(states, index: int, token: str) -> np.ndarray:
    """[pairs, H] at ``hidden_states[index]``: last token or the prompt mean."""
    return np.stack([s[index, -1] if token == "last" else s[index].mean(axis=0) for s in states])


@pytest.mark.parametrize("token", ["last", "mean"])
def test_mean_diff_equals_numpy_on_hf_hidden_states(llm, hidden, token):
    cv = train(llm, POSITIVES, NEGATIVES, layers=[0, 1], token=token, batch_size=3)
    for layer in (0, 1):  # post_mlp of L = hidden_states[L + 1] (the last entry is normed by HF)
        expected = (rows(hidden[0], layer + 1, token) - rows(hidden[1], layer + 1, token)).mean(axis=0)
        assert np.linalg.norm(expected) > 0.01  # a real difference, far above the tolerance
        np.testing.assert_allclose(cv.directions[layer].numpy(), expected, atol=1e-5)
    all_rows = {layer: np.concatenate([np.concatenate([s[layer + 1][-1:] if token == "last" else s[layer + 1]
                                                       for s in side]) for side in hidden]) for layer in (0, 1)}
    for layer in (0, 1):
        assert cv.metadata["residual_norm"][layer] == pytest.approx(np.linalg.norm(all_rows[layer], axis=1).mean(),
                                                                    rel=1e-5)
    assert cv.metadata["pairs"] == len(POSITIVES) and cv.metadata["method"] == "mean_diff"
    assert cv.metadata["model_hint"] == "llama" and cv.hook == "post_mlp"


def test_pre_attn_hook_reads_the_layer_input(llm, hidden):
    cv = train(llm, POSITIVES, NEGATIVES, layers=[1, 2], hook="pre_attn")
    for layer in (1, 2):
        expected = (rows(hidden[0], layer, "last") - rows(hidden[1], layer, "last")).mean(axis=0)
        np.testing.assert_allclose(cv.directions[layer].numpy(), expected, atol=1e-5)
    assert cv.hook == "pre_attn"


def _unit(v):
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("method", ["pca_diff", "pca_center"])
def test_pca_matches_numpy_svd(llm, hidden, method):
    cv = train(llm, POSITIVES, NEGATIVES, layers=[0, 1], method=method)
    for layer in (0, 1):
        pos, neg = rows(hidden[0], layer + 1, "last"), rows(hidden[1], layer + 1, "last")
        if method == "pca_diff":
            matrix = pos - neg  # uncentred
        else:
            center = (pos + neg) / 2
            matrix = np.concatenate([pos - center, neg - center])
        reference = np.linalg.svd(matrix, full_matrices=False)[2][0]
        v = cv.directions[layer].numpy().astype(np.float64)
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)  # unit by default
        assert abs(v @ reference) >= 0.9999
        assert ((pos - neg) @ v).mean() > 0  # the sign: positives project higher
        # The estimate is not the mean difference (else the test would not tell them apart).
        assert abs(v @ _unit((pos - neg).mean(axis=0))) < 0.999


def test_normalize_options(llm, hidden):
    pos, neg = rows(hidden[0], 2, "last"), rows(hidden[1], 2, "last")
    unit = train(llm, POSITIVES, NEGATIVES, layers=[1], normalize=True).directions[1].numpy()
    np.testing.assert_allclose(unit, _unit((pos - neg).mean(axis=0)), atol=1e-5)
    scaled = train(llm, POSITIVES, NEGATIVES, layers=[1], method="pca_diff", normalize=False).directions[1].numpy()
    direction = _unit(scaled.astype(np.float64))
    assert np.linalg.norm(scaled) == pytest.approx(((pos - neg) @ direction).mean(), rel=1e-4)


def test_logistic_separates_the_training_pairs(llm, hidden):
    cv = train(llm, POSITIVES, NEGATIVES, layers=[0, 1], method="logistic")
    for layer in (0, 1):
        v = cv.directions[layer].numpy().astype(np.float64)
        pos, neg = rows(hidden[0], layer + 1, "last"), rows(hidden[1], layer + 1, "last")
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
        assert (pos @ v).min() > (neg @ v).max()  # every positive above every negative


@pytest.mark.parametrize("kwargs, field", [
    (dict(positives=POSITIVES, negatives=NEGATIVES[:-1]), "positives"),
    (dict(positives="one", negatives="two"), "positives"),
    (dict(method="svd"), "method"),
    (dict(token="first"), "token"),
    (dict(hook="mlp"), "hook"),
    (dict(layers=[3]), "layers"),
    (dict(layers=["1"]), "layers"),
    (dict(batch_size=0), "batch_size"),
])
def test_bad_arguments_name_the_field(llm, kwargs, field):
    args = {"positives": POSITIVES, "negatives": NEGATIVES, **kwargs}
    with pytest.raises(ValueError, match=field):
        train(llm, args.pop("positives"), args.pop("negatives"), **args)
    assert not llm.engine.requests
