"""Capture plane: values equal HF activations, labels right under continuous batching, selection,
reductions, budgets, steering, prefix cache, preemption, bad input."""

import random

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit

import steerable
from steerable import LLM, CaptureSpec, SamplingParams, SelectSpec
from steerable.capture import (
    ATTENTION_HEADS,
    HIDDEN_STATES,
    FilesystemConsumer,
    LoggingConsumer,
    match_capture_request_id,
    read_capture_shard,
)

TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "gemma2", "olmo2", "phi3", "gpt2",
                                        "gpt_neox", "gpt_neox_seq"])
def pair(request, capture_dirs):
    path = capture_dirs[request.param]
    return LLM(path, device="cpu", kv_cache_tokens=8192), hf_model(path)


def _hf_states(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states]


def _all_rows_spec(**kw):
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **kw)


def test_hidden_states_and_heads_equal_hf(pair):
    llm, hf = pair
    layers = list(range(llm.engine.model_config.num_layers))
    specs = [CaptureSpec(HIDDEN_STATES, layers=layers, select="all"),
             CaptureSpec(ATTENTION_HEADS, layers=layers, select="all")]
    outs = llm.generate(PROMPTS, _all_rows_spec(capture=specs), use_tqdm=False)
    pre = llm.generate(PROMPTS[:2], _all_rows_spec(capture=CaptureSpec(layers=layers, select="all",
                                                                      hook="pre_attn")), use_tqdm=False)
    for i, out in enumerate(outs):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        n_rows = len(ids) - 1  # the last sampled token is never an input
        states = _hf_states(hf, ids)
        hooked = {}
        HFSteered(hf, []).forward(torch.tensor([ids]), len(out.prompt_token_ids), capture=hooked)
        for layer in layers:
            ours = out.captures[HIDDEN_STATES][layer]
            meta = out.capture_meta[HIDDEN_STATES][layer]
            assert ours.shape[0] == n_rows and meta.positions.tolist() == list(range(n_rows))
            assert meta.token_ids.tolist() == ids[:-1]
            ref = states[layer + 1] if layer + 1 < len(layers) else hooked[("post_mlp", layer)]
            assert (ours - ref[:n_rows]).abs().max() <= TOL
            heads = out.captures[ATTENTION_HEADS][layer]
            assert (heads - hooked[("attention_heads", layer)][:n_rows]).abs().max() <= TOL
            if i < 2:
                assert (pre[i].captures[HIDDEN_STATES][layer] - states[layer][:n_rows]).abs().max() <= TOL
    layout = llm.capture_status(ATTENTION_HEADS)["layouts"][0]
    cfg = llm.engine.model_config
    assert layout == {"num_heads": cfg.num_heads, "head_size": cfg.head_dim, "width": cfg.num_heads * cfg.head_dim}


def test_labels_under_chunked_prefill_16_requests(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=8192, max_num_batched_tokens=24)
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(1, 50))] for _ in range(16)]
    llm.start_capture(HIDDEN_STATES, layers=[0, 2], select="all", dtype="bfloat16")
    outs = llm.generate(prompts, [SamplingParams(max_tokens=rng.randrange(1, 8), temperature=0, ignore_eos=True)
                                  for _ in prompts], use_tqdm=False)
    tensors, meta = llm.fetch_captured(HIDDEN_STATES)
    assert llm.engine.num_steps > 20  # ~400 prompt tokens through a 24-token budget: chunked
    for layer in (0, 2):
        assert tensors[layer].dtype == torch.bfloat16
        rows = {}
        for j, rid in enumerate(meta[layer].req_ids):
            rows.setdefault(rid, []).append(j)
        assert len(rows) == 16
        for out in outs:
            rid = next(r for r in rows if match_capture_request_id(r, out.request_id))
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            idx = rows[rid]
            assert meta[layer].positions[idx].tolist() == list(range(len(ids) - 1))  # complete, ordered
            assert meta[layer].token_ids[idx].tolist() == ids[:-1]
    assert llm.capture_status()["tokens_stored"] == 0  # fetch(clear=True) drained it


def _independent_rows(select, prompt, n_generated):
    """Brute force: rows are inputs at positions 0..P+n-2; apply the spec's literal rules."""
    ids = prompt + [0] * n_generated
    P = len(prompt)
    chosen = []
    for p in range(P + n_generated - 1):
        mask = SelectSpec.parse(select).mask(torch.tensor([p]), P, torch.tensor([ids[p]]))
        if bool(mask[0]):
            chosen.append(p)
    return chosen


@pytest.mark.parametrize("select, expected", [
    ("last_prompt", lambda P, n: [P - 1]),
    ("all_prompt", lambda P, n: list(range(P))),
    ("all_generated", lambda P, n: list(range(P, P + n - 1))),
    ("all", lambda P, n: list(range(P + n - 1))),
    (SelectSpec(positions=[0, 3, 30]), lambda P, n: [p for p in (0, 3, 30) if p < P + n - 1]),
    (SelectSpec(prompt_window=(1, -1)), lambda P, n: list(range(1, P - 1))),
    (SelectSpec(generation_window=(1, 3)), lambda P, n: [P + 1, P + 2]),
    (SelectSpec(prompt="all", exclude_prompt_positions=[0, -1]), lambda P, n: list(range(1, P - 1))),
    (SelectSpec(generation_positions=[0, 2], exclude_generation_positions=[2]), lambda P, n: [P]),
])
def test_select_modes(model_dirs, select, expected):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    prompt = llm.get_tokenizer()(PROMPTS[3]).input_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                               capture=CaptureSpec(layers=[1], select=select)), use_tqdm=False)[0]
    got = out.capture_meta[HIDDEN_STATES][1].positions.tolist()
    assert got == expected(len(prompt), 6) == _independent_rows(select, prompt, 6)


def test_token_id_selection(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    prompt = llm.get_tokenizer()(PROMPTS[1]).input_ids
    wanted = sorted(set(prompt[2:5]))
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=CaptureSpec(
        layers=[0], select=SelectSpec(prompt_tokens=wanted))), use_tqdm=False)[0]
    meta = out.capture_meta[HIDDEN_STATES][0]
    assert meta.positions.tolist() == [p for p, t in enumerate(prompt) if t in wanted]
    assert set(meta.token_ids.tolist()) <= set(wanted)


def test_reduce_last_mean_and_budget(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]
    all_rows = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                    capture=CaptureSpec(layers=[1], select="all")), use_tqdm=False)
    llm.start_capture(layers=[1], reduce="mean")
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    mean_t, mean_m = llm.fetch_captured()
    llm.start_capture(layers=[1], reduce="last")
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    last_t, last_m = llm.fetch_captured()
    for i, out in enumerate(all_rows):
        rows = out.captures[HIDDEN_STATES][1]
        assert torch.allclose(mean_t[1][i], rows.mean(0), atol=1e-6)
        assert torch.equal(last_t[1][i], rows[-1])
    assert mean_m[1].positions.tolist() == [-1] * 3 and mean_m[1].token_ids.tolist() == [-1] * 3
    assert last_m[1].positions.tolist() == [len(o.prompt_token_ids) + 3 for o in all_rows]
    # A budget keeps the first rows per layer and counts the rest as dropped.
    llm.start_capture(layers=[0, 1], select="all", budget_rows=10)
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    status = llm.capture_status()
    total = sum(len(o.prompt_token_ids) + 4 for o in all_rows)
    assert status["rows_stored"] == {0: 10, 1: 10} and status["tokens_dropped"] == 2 * (total - 10)
    tensors, _ = llm.fetch_captured(clear=False)
    assert tensors[0].shape[0] == 10
    llm.stop_capture()
    assert not llm.capture_status()["enabled"] and llm.capture_status()["tokens_stored"] == 20
    llm.clear_captured()
    assert llm.capture_status()["tokens_stored"] == 0


def test_capture_sees_steered_activations(model_dirs):
    path = model_dirs["qwen3"]
    llm, hf = LLM(path, device="cpu", kv_cache_tokens=8192), hf_model(path)
    v = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3).tolist()
    prompt = llm.get_tokenizer()(PROMPTS[5]).input_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                steering_vectors={"post_attn": {1: v}},
                                                capture=CaptureSpec(layers=[1, 2], select="all")),
                       use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    cap = {}
    HFSteered(hf, [("post_attn", 1, add_edit(v), None)]).forward(torch.tensor([ids]), len(prompt), capture=cap)
    plain = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(prompt), capture=plain)
    for layer in (1, 2):
        ours = out.captures[HIDDEN_STATES][layer]
        assert (ours - cap[("post_mlp", layer)][:len(ids) - 1]).abs().max() <= 1e-4
        assert (ours - plain[("post_mlp", layer)][:len(ids) - 1]).abs().max() > 0.1


def test_prefix_cache_recomputes_needed_prompt_rows(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    def hit_tokens():
        return llm.llm_engine.stats()["prefix_cache_hit_tokens"]

    prompt = list(range(30, 100))  # 70 tokens, 4 full blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    hits = hit_tokens()
    full = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=CaptureSpec(
        layers=[0, 2], select="all_prompt")), use_tqdm=False)[0]
    assert hit_tokens() == hits  # every prompt row was needed: nothing served from cache
    cold = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192, enable_prefix_caching=False)
    ref = cold.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=CaptureSpec(
        layers=[0, 2], select="all_prompt")), use_tqdm=False)[0]
    for layer in (0, 2):
        assert full.capture_meta[HIDDEN_STATES][layer].positions.tolist() == list(range(70))
        assert torch.equal(full.captures[HIDDEN_STATES][layer], ref.captures[HIDDEN_STATES][layer])
    # Rows from position 40 on: the cache may serve the first 32 tokens (2 blocks).
    late = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=CaptureSpec(
        layers=[2], select=SelectSpec(prompt_window=(40, None)))), use_tqdm=False)[0]
    assert hit_tokens() == hits + 32
    assert torch.equal(late.captures[HIDDEN_STATES][2], ref.captures[HIDDEN_STATES][2][40:])
    # Generated rows only: the cache is used fully.
    gen = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=CaptureSpec(
        layers=[2], select="all_generated")), use_tqdm=False)[0]
    assert hit_tokens() == hits + 32 + 64
    assert gen.capture_meta[HIDDEN_STATES][2].positions.tolist() == [70, 71]
    # skip_reading_prefix_cache is honoured.
    llm.generate([prompt], SamplingParams(max_tokens=2, skip_reading_prefix_cache=True), use_tqdm=False)
    assert hit_tokens() == hits + 96


def test_preemption_delivers_each_row_once(capture_dirs):
    path = capture_dirs["qwen3"]
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(20, 50))] for _ in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            capture=CaptureSpec(layers=[0, 2], select="all"))
    ref = LLM(path, device="cpu", kv_cache_tokens=8192)
    expected = ref.generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64)
    llm.start_capture(layers=[1], select="all")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    stream_t, stream_m = llm.fetch_captured()
    for out, exp in zip(outs, expected):
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        n = len(out.prompt_token_ids) + 12 - 1
        for layer in (0, 2):
            assert out.capture_meta[HIDDEN_STATES][layer].positions.tolist() == list(range(n))
            assert (out.captures[HIDDEN_STATES][layer] - exp.captures[HIDDEN_STATES][layer]).abs().max() <= TOL
        mine = [j for j, rid in enumerate(stream_m[1].req_ids) if match_capture_request_id(rid, out.request_id)]
        assert stream_m[1].positions[mine].tolist() == list(range(n))
    assert stream_t[1].shape[0] == sum(len(p) + 11 for p in prompts)


def test_capture_helper_and_batches(model_dirs, tmp_path):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    result = steerable.capture(llm, PROMPTS[:4], layers=[0, 2])
    assert result.layer_ids == [0, 2] and len(result) == 4
    assert result.rows(2).shape == (4, 64)
    meta = result.meta(2)
    assert meta.positions.tolist() == [len(o.prompt_token_ids) - 1 for o in result.outputs]
    assert torch.equal(result.sample(1)[2][0], result.rows(2)[1])
    assert result.to_nested()[3][0].shape == (1, 64)
    consumer = FilesystemConsumer(tmp_path)
    logger = LoggingConsumer()
    llm.add_capture_consumer(logger)
    batches = list(steerable.capture_batches(llm, PROMPTS, batch_size=3, consumer=consumer, layers=[1],
                                             select="all_prompt"))
    assert [len(b) for b in batches] == [3, 3, 2]
    assert len(consumer.paths) == 8 and logger.num_captures == 8
    tensors, meta = read_capture_shard(consumer.paths[0])
    assert torch.equal(tensors[1], batches[0].sample(0)[1])
    assert meta[1].positions.tolist() == list(range(len(batches[0].outputs[0].prompt_token_ids)))


def test_router_logits_rejected_on_dense_model(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match="stream"):
        llm.start_capture("router_logits")
    with pytest.raises(ValueError, match="capture.stream"):
        llm.generate(["hi"], SamplingParams(capture=CaptureSpec("router_logits")), use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(stream="nope"), "stream"),
    (dict(layers=[3]), "layers"),
    (dict(layers=[-1]), "layers"),
    (dict(reduce="median"), "reduce"),
    (dict(reduce="mean", select="all"), "select"),
    (dict(budget_rows=-1), "budget_rows"),
    (dict(select={"prompt_window": [4, 1]}), "select"),
    (dict(dtype="int8"), "dtype"),
    (dict(hook="mid"), "hook"),
])
def test_bad_stream_input(model_dirs, kwargs, field):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match=field):
        llm.start_capture(**kwargs)
    assert not llm.capture_status()["enabled"]


@pytest.mark.parametrize("spec, field", [
    (CaptureSpec("nope"), "capture.stream"),
    (CaptureSpec(layers=[9]), "capture.layers"),
    (CaptureSpec(select="sometimes"), "capture.select"),
    (CaptureSpec(dtype="int4"), "capture.dtype"),
    ([CaptureSpec(), CaptureSpec()], "capture.stream"),
    ("hidden_states", "capture"),
])
def test_bad_request_capture(model_dirs, spec, field):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match=field):
        llm.generate(["hello"], SamplingParams(capture=spec, steering_vectors={0: [0.5] * 64}), use_tqdm=False)
    assert llm.llm_engine.stats()["num_requests"] == 0 and llm.get_steering_status()["configs_in_use"] == 0
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_draining_forgets_requests_and_fetch_checks_layers(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    llm.start_capture(layers=[0, 1], select="last_prompt")
    for _ in range(3):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
        tensors, _ = llm.fetch_captured()
        assert tensors[0].shape[0] == 2
    status = llm.capture_status()
    assert status["tokens_stored"] == 0 and status["requests"] == 0
    with pytest.raises(ValueError, match="layers"):
        llm.fetch_captured(layers=[2])
