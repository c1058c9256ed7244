"""What ``help``, an IDE and the REPL show: the public names keep their signatures and docstrings
through the lazy exports (``steerable.capture`` is a callable module, ``AsyncLLM`` passes ``LLM``'s
arguments on), and capture results print as shapes, layers and rows, never as every value."""

from __future__ import annotations

import inspect
import pydoc

import pytest
from conftest import PROMPTS
from test_sae_registry import random_sae

import steerable
from steerable import LLM, CaptureSpec, SamplingParams
from steerable.capture.api import capture as capture_function
from steerable.entrypoints.engine_process import ProcessAsyncLLM


def test_the_callable_capture_module_shows_the_function():
    assert inspect.signature(steerable.capture) == inspect.signature(capture_function)
    page = pydoc.render_doc(steerable.capture, renderer=pydoc.plaintext)
    assert "steerable.capture(llm: " in page and inspect.getdoc(capture_function).splitlines()[0] in page


def test_lazy_exports_are_listed_and_keep_their_signatures():
    assert set(steerable.__all__) <= set(dir(steerable))
    page = pydoc.render_doc(steerable, renderer=pydoc.plaintext)
    assert "class LLM" in page and "class SamplingParams" in page
    for cls in (steerable.AsyncLLM, ProcessAsyncLLM):
        params = inspect.signature(cls).parameters
        assert list(params)[:3] == ["model", "dtype", "device"] and "kv_cache_tokens" in params
    assert list(inspect.signature(steerable.AsyncLLM.set_steering_vectors).parameters) == ["self", "spec", "replace"]


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=2048)
    llm.register_sae("res1", random_sae(d_in=llm.model_config.hidden_size, layer=1))
    return llm


def test_results_print_their_shapes_not_their_values(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, capture=[
        CaptureSpec(layers=[0, 2], select="all"), CaptureSpec(stream="attention_patterns", layers=[1], heads=[0, 2]),
        CaptureSpec(stream="sae_features", saes=["res1"], top_k=4)]), use_tqdm=False)[0]
    rows = out.captures["hidden_states"][0].shape[0]
    text = repr(out)
    assert f"'hidden_states': {{0: Tensor[{rows}, 64] float32, 2: Tensor[{rows}, 64] float32}}" in text
    assert f"AttentionPatterns(rows={rows}, heads=[0, 2], keys per row=1-{rows}, dtype=float32)" in text
    assert f"SparseFeatures(rows={rows}, top_k=4, active per row=" in text
    assert "tensor(" not in text and len(text) < 3000
    assert "Tensor[" in repr(out.outputs[0]) and "tensor(" not in repr(out.outputs[0])

    result = steerable.capture(llm, PROMPTS[:3], layers=[1, 2])
    assert repr(result) == ("CaptureResult(stream='hidden_states', prompts=3, layers=[1, 2], rows={1: 3, 2: 3}, "
                            "layouts={1: {'width': 64}, 2: {'width': 64}})")
    features = steerable.capture(llm, PROMPTS[:2], stream="sae_features", saes=["res1"], top_k=4, select="all")
    assert repr(features).startswith("CaptureResult(stream='sae_features', prompts=2, layers=['res1'], rows={'res1': ")
    assert repr(features.rows("res1")).startswith(f"SparseFeatures(rows={len(features.meta('res1'))}, top_k=4")
