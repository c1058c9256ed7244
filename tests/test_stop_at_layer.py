"""Requests that stop at a layer (corpus capture's requests, TransformerLens' ``stop_at_layer``):
the layers from there up never run, the captured rows are bit-equal to a full forward's, their
KV blocks are nobody else's prefix, a step mixing them with ordinary requests runs every layer,
and bad values are refused naming the field."""

import pytest
import torch

import steerable
from steerable import LLM, SamplingParams
from steerable.entrypoints.llm import run_to_completion
from steerable.errors import InvalidRequestError
from steerable.hook_points import HIDDEN_STATES, layers_needed
from steerable.selection import SelectSpec

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def llm(capture_dirs):
    llm = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048, enable_prefix_caching=True)
    yield llm
    llm.shutdown()


@pytest.fixture
def layer_calls(llm):
    """How many times each decoder layer ran."""
    calls = [0] * llm.llm_engine.model_config.num_layers
    handles = [layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(llm.llm_engine.worker.model.layers)]
    yield calls
    for handle in handles:
        handle.remove()


def run(llm, prompts, stop, prefix="stop", params=PARAMS):
    engine = llm.llm_engine
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    return run_to_completion(engine, ids, queued=engine.queue_requests(
        [(i, p, params) for i, p in zip(ids, prompts)], stop_at_layer=stop))


def captured(llm, prompts, layers, hook, stop):
    """Every prompt row at ``layers`` through a hidden-states stream, the requests stopping at ``stop``."""
    engine = llm.llm_engine
    engine.start_capture(HIDDEN_STATES, layers, "float32", "all", SelectSpec.parse("all_prompt"), None, hook)
    try:
        outs = run(llm, prompts, stop, prefix=f"cap{stop}")
    finally:
        engine.stop_capture(HIDDEN_STATES)
    rows, _ = engine.fetch_captured(HIDDEN_STATES, True, None, [o.request_id for o in outs])
    return rows


def test_layers_needed():
    assert layers_needed([1, 3], "post_mlp") == 4
    assert layers_needed([3], "pre_attn") == 3
    assert layers_needed([0], "pre_attn") == 0
    assert layers_needed([2], "mlp_in") == 3


@pytest.mark.parametrize("hook, layers", [("post_mlp", [1]), ("pre_attn", [2]), ("post_attn", [0, 1]),
                                          ("pre_attn", [0])])
def test_rows_equal_a_full_forward_and_the_layers_above_never_run(llm, layer_calls, hook, layers):
    stop = layers_needed(layers, hook)
    stopped = captured(llm, PROMPTS, layers, hook, stop)
    assert all((calls > 0) == (i < stop) for i, calls in enumerate(layer_calls)), layer_calls
    full = captured(llm, PROMPTS, layers, hook, None)
    assert set(stopped) == set(full) == set(layers)
    for layer in layers:
        assert torch.equal(stopped[layer], full[layer]) and stopped[layer].abs().sum() > 0


def test_hf_agrees_at_the_stopping_point(llm, capture_dirs):
    """pre_attn of layer L with L layers run is HF's hidden_states[L]: the tail reproduces the add."""
    from conftest import hf_model

    model = hf_model(capture_dirs["llama"])
    rows = captured(llm, PROMPTS[:1], [2], "pre_attn", 2)[2]
    with torch.no_grad():
        reference = model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[2][0]
    torch.testing.assert_close(rows, reference, rtol=1e-5, atol=1e-5)


def test_stopped_blocks_are_no_prefix_of_full_requests(llm):
    prompt = [1] + list(range(60, 100))  # several blocks
    run(llm, [prompt], 1, prefix="salted")
    full = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    assert full.num_cached_tokens == 0  # the stopped request's blocks hold KV of its first layer only
    fresh = LLM(llm.llm_engine.config.model, device="cpu", kv_cache_tokens=2048, enable_prefix_caching=True)
    try:
        expected = fresh.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    finally:
        fresh.shutdown()
    assert full.outputs[0].token_ids == expected.outputs[0].token_ids
    again = run(llm, [prompt], 1, prefix="salted-again")[0]
    assert again.num_cached_tokens > 0  # a request stopping at the same layer may share them


def test_a_step_with_an_ordinary_request_runs_every_layer(llm, layer_calls):
    engine = llm.llm_engine
    alone = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    layer_calls[:] = [0] * len(layer_calls)
    engine.add_request("ordinary", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.0, cache_salt="mix"))
    engine.add_request("stopped", PROMPTS[0], PARAMS, stop_at_layer=1)
    outs = run_to_completion(engine, ["ordinary", "stopped"])
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].finished and len(outs[1].outputs[0].token_ids) == 1
    assert layer_calls[-1] >= 1  # the first step held both: it ran to the last layer


@pytest.mark.parametrize("stop, params, match", [
    (5, PARAMS, "stop_at_layer: expected a layer count"),
    (-1, PARAMS, "stop_at_layer: expected a layer count"),
    ("1", PARAMS, "stop_at_layer: expected a layer count"),
    (1, SamplingParams(max_tokens=2), "stop_at_layer: the request computes no logits"),
    (1, SamplingParams(max_tokens=1, prompt_logprobs=1), "stop_at_layer: the request computes no logits"),
])
def test_bad_values_are_refused_and_the_engine_keeps_serving(llm, stop, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.llm_engine.add_request("bad", PROMPTS[0], params, stop_at_layer=stop)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_corpus_capture_stops_at_the_captured_layer(llm, layer_calls, tmp_path):
    steerable.capture_corpus(llm, PROMPTS, tmp_path, layers=[0], hook="post_mlp", shard_size=2)
    assert layer_calls[0] > 0 and sum(layer_calls[1:]) == 0
