"""The activation store (issue 47): a request capturing every prompt row gets the rows of the
prefix-cache blocks it hits from the store, keyed like the prefix cache, instead of recomputing
them. Against an engine without a store (which recomputes them), in float32 on a CPU: the same
rows bit for bit, each exactly once, labelled; the prefix hit stands. A steered prefix never
serves an unsteered prefix's rows, nor the reverse; a full store evicts and recomputes; preemption,
aborts, SAE features and a pipeline of two stages; the counters in ``/metrics``."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_sae_capture import random_sae
from transcoder_helpers import random_transcoder

from steerable import LLM, CaptureSpec, SamplingParams, SelectSpec, SteeringSpec
from steerable.capture import match_capture_request_id
from steerable.entrypoints.cli.common import CliError, engine_kwargs

SYSTEM = list(range(7, 63))  # 56 tokens: three whole blocks of 16, then 8 into the fourth
STORE = 1 << 24
LAYERS = [0, 1, 2]


def _llm(path: str, store: int = STORE, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4,
               activation_store_bytes=store, **kwargs)


def _prompts(n: int, start: int = 0) -> list[list[int]]:
    return [SYSTEM + [100 + i] * (3 + 5 * i) for i in range(start, start + n)]  # ids < 384


def _params(capture, max_tokens: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, capture=capture, **kwargs)


def _assert_same(got, want, atol: float = 0.0) -> None:
    """Equal tokens and captures (every component and layer; bit for bit unless ``atol``), equal
    labels (each engine labels rows with its own request ids)."""
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert set(got.captures) == set(want.captures)
    for component, layers in want.captures.items():
        assert set(got.captures[component]) == set(layers)
        for layer, tensor in layers.items():
            mine = got.captures[component][layer]
            assert mine.shape == tensor.shape and (mine - tensor).abs().max() <= atol, (component, layer)
            meta, want_meta = got.capture_meta[component][layer], want.capture_meta[component][layer]
            assert torch.equal(meta.positions, want_meta.positions) and torch.equal(meta.token_ids, want_meta.token_ids)
            assert all(match_capture_request_id(r, got.request_id) for r in meta.req_ids)


def _hits(llm: LLM) -> tuple[int, int]:
    stats = llm.llm_engine.stats()
    return stats["activation_store_hits"], stats["prefix_cache_hit_tokens"]


SELECTS = ["all_prompt", "all", SelectSpec(prompt_window=(10, 60)), SelectSpec(prompt="all", exclude_prompt_positions=[0, 17]),
           "last_prompt"]


@pytest.fixture(scope="module")
def served(capture_dirs):
    """One engine with a store, one without: the first chat fills the store (every prompt row at
    every layer, and attention heads at one), then chats on the same system prompt capture prompt
    rows through several selections, with a stream of every prompt row at layer 1 beside them."""
    path = capture_dirs["qwen3"]
    fill = [CaptureSpec(layers=LAYERS, select="all_prompt"), CaptureSpec("attention_heads", layers=[1], select="all")]
    chats = _prompts(len(SELECTS), start=1)
    params = [_params([CaptureSpec(layers=LAYERS, select=s), CaptureSpec("attention_heads", layers=[1], select=s)])
              for s in SELECTS]
    runs = {}
    for store in (STORE, 0):
        llm = _llm(path, store)
        first = llm.generate([_prompts(1)[0]], _params(fill), use_tqdm=False)
        before = _hits(llm)
        llm.start_capture(layers=[1], select="all_prompt")
        outs = llm.generate(chats, params, use_tqdm=False)
        llm.stop_capture()
        after = _hits(llm)
        runs[store] = dict(first=first, outs=outs, stream=llm.fetch_captured(), stats=llm.llm_engine.stats(),
                           hits=after[0] - before[0], hit_tokens=after[1] - before[1])
        llm.shutdown()
    return runs


def test_prefix_hit_rows_equal_recomputed_rows_exactly_once(served):
    stored, recomputed = served[STORE], served[0]
    _assert_same(stored["first"][0], recomputed["first"][0])
    for got, want in zip(stored["outs"], recomputed["outs"]):
        _assert_same(got, want)
    # The hits stand: every chat takes the three whole system-prompt blocks from the prefix cache
    # (without a store the stream, which needs every prompt row, makes every chat recompute them).
    assert stored["hit_tokens"] == 48 * len(SELECTS) and recomputed["hit_tokens"] == 0
    # Served blocks: 4 chats of 5 need rows in the three blocks, hidden states and heads; the stream
    # needs them for all 5.
    assert stored["hits"] == 4 * 2 * 3 + 5 * 3 and stored["stats"]["activation_store_misses"] == 0
    for out, select in zip(stored["outs"], SELECTS):
        P = len(out.prompt_token_ids)
        generated = len(out.outputs[0].token_ids) - 1
        want = {"all_prompt": list(range(P)), "all": list(range(P + generated)), "last_prompt": [P - 1]}.get(
            select if isinstance(select, str) else None)
        if want is None:
            want = [p for p in range(P) if (10 <= p < 60 if select.prompt_window else p not in (0, 17))]
        meta = out.capture_meta["hidden_states"][2]
        assert meta.positions.tolist() == want  # each row once, in order
        assert meta.token_ids.tolist() == [(out.prompt_token_ids + out.outputs[0].token_ids)[p] for p in want]
        assert all(match_capture_request_id(r, out.request_id) for r in meta.req_ids)
    # The stream: rows in the order the engines delivered them (served rows come with a chat's first
    # step), the same per request.
    (tensors, metas), (ref_tensors, ref_metas) = stored["stream"], recomputed["stream"]
    assert len(metas[1]) == len(ref_metas[1]) == sum(len(o.prompt_token_ids) for o in stored["outs"])
    for stream_out, ref_out in zip(stored["outs"], recomputed["outs"]):
        mine = [i for i, r in enumerate(metas[1].req_ids) if match_capture_request_id(r, stream_out.request_id)]
        ref = [i for i, r in enumerate(ref_metas[1].req_ids) if match_capture_request_id(r, ref_out.request_id)]
        assert metas[1].positions[mine].tolist() == list(range(len(stream_out.prompt_token_ids)))
        assert torch.equal(metas[1].token_ids[mine], ref_metas[1].token_ids[ref])
        assert torch.equal(tensors[1][mine], ref_tensors[1][ref])


def test_steered_and_unsteered_prefixes_never_share_rows(capture_dirs):
    """Prefill steering changes a block's hash: its rows are never served to an unsteered request,
    nor an unsteered block's to a steered one. Decode-only steering keeps prompt blocks (and their
    stored rows) shared, and its prompt rows are the unsteered ones."""
    path = capture_dirs["qwen3"]
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 2
    steered = dict(steering_vectors=SteeringSpec(prefill_vectors={1: vector}))
    decode = dict(steering_vectors=SteeringSpec(decode_vectors={1: vector}))
    capture = CaptureSpec(layers=LAYERS, select="all_prompt")
    prompt = _prompts(1)[0]
    reference = _llm(path, 0)
    want = {name: reference.generate([prompt], _params(capture, cache_salt=name, **kw), use_tqdm=False)[0]
            for name, kw in (("plain", {}), ("steered", steered), ("decode", decode))}
    reference.shutdown()
    assert not torch.allclose(want["plain"].captures["hidden_states"][2], want["steered"].captures["hidden_states"][2])
    assert torch.equal(want["plain"].captures["hidden_states"][2], want["decode"].captures["hidden_states"][2])
    for order in (("plain", "steered"), ("steered", "plain")):
        llm = _llm(path)
        for name in order:
            kw = steered if name == "steered" else {}
            before = _hits(llm)
            got = llm.generate([prompt], _params(capture, **kw), use_tqdm=False)[0]
            assert _hits(llm) == before  # the other prefix's blocks: neither KV nor rows
            _assert_same(got, want[name])
        llm.shutdown()
    llm = _llm(path)
    llm.generate([prompt], _params(capture), use_tqdm=False)
    before = _hits(llm)
    got = llm.generate([prompt], _params(capture, **decode), use_tqdm=False)[0]
    hits, hit_tokens = _hits(llm)
    assert hits - before[0] == 3 and hit_tokens - before[1] == 48
    assert torch.equal(got.captures["hidden_states"][2], want["decode"].captures["hidden_states"][2])
    llm.shutdown()


def test_full_store_evicts_and_recomputes(capture_dirs):
    """A budget of three blocks' rows: chats on four system prompts keep evicting each other's
    blocks, within the budget, and recompute what is gone; a budget below one block keeps nothing.
    Rows as an engine without a store gives them."""
    path = capture_dirs["qwen3"]
    block_bytes = 16 * 64 * 4  # one layer's rows of one block, float32
    capture = CaptureSpec(layers=[1], select="all_prompt")
    systems = [[s + i for i in range(40)] for s in (5, 100, 200, 300)]
    prompts = [system + [370 + k] for k in range(3) for system in systems]
    expected = _llm(path, 0).generate(prompts, _params(capture), use_tqdm=False)
    for capacity in (3 * block_bytes, block_bytes - 1):
        llm = _llm(path, capacity)
        for prompt, want in zip(prompts, expected):  # one at a time: each finds what the last ones left
            _assert_same(llm.generate([prompt], _params(capture), use_tqdm=False)[0], want)
        stats = llm.llm_engine.stats()
        assert stats["activation_store_bytes"] <= capacity
        if capacity > block_bytes:
            assert stats["activation_store_evictions"] > 0 and stats["activation_store_misses"] > 0
        else:
            assert stats["activation_store_blocks"] == 0 and stats["activation_store_hits"] == 0
        llm.shutdown()


def test_missing_layers_are_recomputed(capture_dirs):
    """Rows stored at layer 0 only do not serve a capture of layers 0 and 1: its hit stops at its
    first row and it recomputes (counted as misses)."""
    path = capture_dirs["qwen3"]
    first, second = _prompts(2)
    llm = _llm(path)
    llm.generate([first], _params(CaptureSpec(layers=[0], select="all_prompt")), use_tqdm=False)
    both = CaptureSpec(layers=[0, 1], select="all_prompt")
    got = llm.generate([second], _params(both), use_tqdm=False)[0]
    stats = llm.llm_engine.stats()
    assert stats["activation_store_hits"] == 0 and stats["activation_store_misses"] == 3
    assert stats["prefix_cache_hit_tokens"] == 0
    _assert_same(got, _llm(path, 0).generate([second], _params(both), use_tqdm=False)[0])
    llm.shutdown()


def test_preemption_and_aborts(capture_dirs):
    """A KV cache too small for the batch: requests are preempted and resume from prefix hits the
    store serves; every row once, as without a store or preemption (within float32 rounding: prefill
    chunked at other boundaries moves a row by 1e-7, store or not, as in test_capture's preemption
    test). An aborted request leaves no lookup or capture state behind."""
    path = capture_dirs["qwen3"]
    prompts = _prompts(8)
    params = _params(CaptureSpec(layers=[0, 2], select="all"), max_tokens=10)
    expected = _llm(path, 0).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=320, max_num_batched_tokens=64,
              activation_store_bytes=STORE)
    llm.generate([prompts[0]], params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["activation_store_hits"] > 0
    for got, want in zip(outs, expected):
        _assert_same(got, want, atol=1e-5)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"abort-{i}", prompt, params)
    engine.step()
    engine.abort_request([f"abort-{i}" for i in range(3)])
    engine.finish_inflight()
    assert not engine.capture.prefix_rows._pending
    assert engine.stats()["capture_requests_in_use"] == 0 and engine.stats()["num_requests"] == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    llm.shutdown()


def test_sae_and_transcoder_rows_from_the_store(capture_dirs):
    """SAE features, a cross-layer transcoder's features (keyed by registration and top-k) and its
    error node come from the store on a hit, equal to recomputation."""
    path = capture_dirs["qwen3"]
    specs = [CaptureSpec(stream="sae_features", saes=["res", "clt"], top_k=8, select="all_prompt"),
             CaptureSpec(stream="transcoder_error", saes=["clt"], select="all_prompt")]
    outs = {}
    for store in (STORE, 0):
        llm = _llm(path, store)
        llm.register_sae("res", random_sae(64, "relu", 1))
        llm.register_sae("clt", random_transcoder(layers=3, layer=0, cross_layer=True, hook="post_attn", seed=3))
        outs[store] = llm.generate(_prompts(1), _params(specs), use_tqdm=False)
        outs[store] += llm.generate(_prompts(2, start=1), _params(specs), use_tqdm=False)
        if store:  # 2 chats x 3 blocks, for the SAE's features, the transcoder's and its error node
            assert llm.llm_engine.stats()["activation_store_hits"] == 2 * 3 * 3
        llm.shutdown()
    for got, want in zip(outs[STORE], outs[0]):
        for name in ("res", "clt"):
            a, b = got.captures["sae_features"][name], want.captures["sae_features"][name]
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
            meta, want_meta = got.capture_meta["sae_features"][name], want.capture_meta["sae_features"][name]
            assert torch.equal(meta.positions, want_meta.positions) and torch.equal(meta.token_ids, want_meta.token_ids)
        assert torch.equal(got.captures["transcoder_error"]["clt"], want.captures["transcoder_error"]["clt"])
        assert got.capture_meta["transcoder_error"]["clt"].positions.tolist() == list(range(len(got.prompt_token_ids)))


def test_pipeline_stages_fill_and_serve_the_store(capture_dirs, monkeypatch):
    """The driver owns the store: under two pipeline stages (each computing its layers' rows) the
    merged rows are stored and served as on one rank."""
    from steerable.executor.launch import START_METHOD_ENV

    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    path = capture_dirs["llama"]
    capture = CaptureSpec(layers=LAYERS, select="all_prompt")
    expected = _llm(path, 0).generate(_prompts(3), _params(capture), use_tqdm=False)
    llm = _llm(path, pipeline_parallel_size=2)
    try:
        got = llm.generate(_prompts(1), _params(capture), use_tqdm=False)
        got += llm.generate(_prompts(2, start=1), _params(capture), use_tqdm=False)
        assert llm.llm_engine.stats()["activation_store_hits"] == 2 * 3
    finally:
        llm.shutdown()
    for a, b in zip(got, expected):
        _assert_same(a, b)


def test_engine_flags():
    args = dict(model="m", revision=None, gguf_file=None, dtype="auto", device="cpu", max_model_len=None,
                max_num_seqs=4, max_num_batched_tokens=64, block_size=16, gpu_memory_utilization=0.9,
                kv_cache_tokens=None, enable_prefix_caching=True, enforce_eager=False, seed=0, cpu_threads=None,
                tensor_parallel_size=1, pipeline_parallel_size=1, activation_store_bytes=1 << 20)
    assert engine_kwargs(argparse.Namespace(**args))["activation_store_bytes"] == 1 << 20
    with pytest.raises(CliError, match="activation_store_bytes"):
        engine_kwargs(argparse.Namespace(**{**args, "activation_store_bytes": -1}))


def test_metrics_count_store_hits_misses_and_bytes(capture_dirs):
    """``/metrics`` of a server whose engine has a store: two completions capturing every prompt row
    of one system prompt, the second served from the store."""
    from server_harness import app_in_thread

    from steerable import AsyncLLM
    from steerable.entrypoints.openai.metrics import Metrics

    assert b"steerable:activation_store_hits_total 0.0" in Metrics().render(_llm(capture_dirs["qwen3"], 0)
                                                                           .llm_engine.stats())
    llm = AsyncLLM(capture_dirs["qwen3"], device="cpu", kv_cache_tokens=1024, activation_store_bytes=STORE)
    with app_in_thread(llm) as c:
        for prompt in _prompts(2):
            body = {"prompt": prompt, "max_tokens": 2, "capture": {"layers": [1], "select": "all_prompt"}}
            assert c.post("/v1/completions", json=body).status_code == 200
        values = {}
        for line in c.get("/metrics").text.splitlines():
            if line.startswith("steerable:activation_store"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
    assert values["steerable:activation_store_hits_total"] == 3
    assert values["steerable:activation_store_misses_total"] == 0
    assert values["steerable:activation_store_bytes"] >= 3 * 16 * 64 * 4
    assert "steerable:activation_store_evictions_total" in values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_store_on_gpu_with_graphs(capture_dirs):
    """On a GPU (Triton attention, CUDA graphs, shared-prefix attention): chats capturing every
    prompt row at every layer take the system prompt's rows from the store, whose rows are the
    filling chat's bit for bit, the rest within the tolerance of test_gpu's float32 captures of an
    engine without a store; no step captures without its graph."""
    path = capture_dirs["qwen3"]
    capture = CaptureSpec(layers=LAYERS, select="all_prompt")
    prompts = _prompts(12)
    runs = {}
    for store in (STORE, 0):
        llm = LLM(path, device="cuda", dtype="float32", kv_cache_tokens=8192, max_num_seqs=8,
                  activation_store_bytes=store)
        first = llm.generate(prompts[:1], _params(capture), use_tqdm=False)
        runs[store] = (first, llm.generate(prompts[1:], _params(capture), use_tqdm=False), llm.llm_engine.stats(),
                       llm.capture_status())
        llm.shutdown()
    (first, outs, stats, status), (_, expected, _, _) = runs[STORE], runs[0]
    assert stats["activation_store_hits"] == 11 * 3 and stats["prefix_cache_hit_tokens"] == 11 * 48
    assert status["eager_capture_forwards"] == 0 and status["graph_replays"] > 0
    for got, want in zip(outs, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for layer in LAYERS:
            mine, theirs = got.captures["hidden_states"][layer], want.captures["hidden_states"][layer]
            assert torch.equal(mine[:48], first[0].captures["hidden_states"][layer][:48])
            assert (mine - theirs).abs().max() <= 1e-4
            assert got.capture_meta["hidden_states"][layer].positions.tolist() == list(range(len(got.prompt_token_ids)))
