"""GPU: the CPU fidelity cases on CUDA in float32 (Triton attention, CUDA graphs on), and graph
replay == eager in bfloat16 with steering and capture inside the graph (Qwen3, Gemma 2, and Gemma 3
270M- and 4B-shaped random models, whose sliding windows the prompts outgrow); Gemma 2 in bfloat16
against HF in bfloat16."""

import random
import threading

import pytest
import torch
from conftest import PROMPTS, hf_greedy, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap

from steerable import LLM, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _vec(seed, scale=3.0):
    return (torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def _assert_bf16_greedy_close(path: str, outs, tokens: int) -> None:
    """Our bfloat16 greedy tokens against HF's bfloat16 ``generate`` on the same weights, compared as
    vLLM compares bf16 models with HF (``check_logprobs_close``): equal up to the first difference,
    and where the two part, their tokens are a near tie in a float32 forward of the same
    bf16-rounded weights (logits within 1 % of the largest logit), after which the sequences are no
    longer comparable. Random tiny models have such ties (top-2 gaps of 0.1 % of the logits), which
    bf16 rounding order decides; a real difference (a wrong soft-cap, a wrong norm) parts with a
    wide margin. At least 3/4 of all tokens must compare equal, so early divergence cannot pass."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager"
                                                ).float().cuda().eval()
    equal = total = 0
    for out in outs:
        ids = out.prompt_token_ids
        t = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            ref = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        total += tokens
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), tokens)
        equal += same
        if same < tokens:
            with torch.no_grad():
                logits = hf32(torch.tensor([ids + ours[:same]], device="cuda")).logits[0, -1].float()
            gap = (logits[ours[same]] - logits[ref[same]]).abs().item()
            assert gap <= 0.01 * logits.abs().max().item(), (out.prompt, same, gap)
    assert equal >= 0.75 * total, (equal, total)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "olmo2", "phi3", "gpt2",
                                    "gpt_neox", "gpt_neox_seq"])
def test_greedy_matches_hf_on_gpu(model_dirs, family):
    llm = LLM(model_dirs[family], dtype="float32", device="cuda", kv_cache_tokens=8192)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = hf_model(model_dirs[family])
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16)
    assert llm.llm_engine.stats()["graph_replays"] > 0


def test_graphs_captured_mid_run_leave_other_threads_working(model_dirs):
    """The engine captures graphs lazily (here: for each new steering vector) while a consumer on
    another thread (a dashboard pass, an activation stream) allocates and synchronises on its own
    stream; in the global capture mode the consumer's calls failed ("operation not permitted when
    stream is capturing"). Both sides finish, and graphed tokens equal an eager engine's."""
    path = model_dirs["qwen3"]
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192)
    eager = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192, enforce_eager=True)
    stop, errors = threading.Event(), []

    def consumer():
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    x = torch.randn(2048, 256, device="cuda")
                    (x @ x.T).sum().item()
        except Exception as err:  # noqa: BLE001 (reported by the assertion below)
            errors.append(err)

    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             steering_vectors=SteeringSpec(vectors={"post_mlp": {1: _vec(seed)}})) for seed in range(6)]
    before = llm.llm_engine.stats()["graph_captures"]
    thread = threading.Thread(target=consumer)
    thread.start()
    try:
        outs = [llm.generate(PROMPTS[:3], p, use_tqdm=False) for p in params]
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert llm.llm_engine.stats()["graph_captures"] > before
    for p, out in zip(params, outs):
        ref = eager.generate(PROMPTS[:3], p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    llm.shutdown()
    eager.shutdown()


@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_mlp"])
def test_steering_matches_hf_on_gpu(model_dirs, hook):
    path = model_dirs["qwen3"]
    llm, hf = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192), hf_model(path)
    ids = llm.get_tokenizer()(PROMPTS[3]).input_ids
    v, d = _vec(1), _vec(2)
    spec = SteeringSpec(interventions=[], vectors={hook: {1: v}},
                        clamps=[Clamp(2, d, hook=hook, min=-0.5, max=0.5)],
                        decode_vectors={"pre_attn": {0: _vec(3)}})
    out = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5,
                                             steering_vectors=spec), use_tqdm=False)[0]
    edits = [(hook, 1, add_edit(v), None), (hook, 2, clamp_edit(d, -0.5, 0.5), None),
             ("pre_attn", 0, add_edit(_vec(3)), SelectSpec(generation="all"))]
    tokens, lp = HFSteered(hf, edits).greedy(ids, 10)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, lp) <= 1e-3  # TF32-free fp32 on GPU, different reduction orders


def test_capture_matches_hf_on_gpu(capture_dirs):
    path = capture_dirs["llama"]
    llm, hf = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192), hf_model(path)
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=[
        CaptureSpec(layers=[0, 1, 2], select="all"), CaptureSpec("attention_heads", layers=[1], select="all")]),
        use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        cap = {}
        HFSteered(hf, []).forward(torch.tensor([ids]), len(out.prompt_token_ids), capture=cap)
        n = len(ids) - 1
        for layer in (0, 1, 2):
            assert out.capture_meta["hidden_states"][layer].positions.tolist() == list(range(n))
            assert (out.captures["hidden_states"][layer].cpu() - cap[("post_mlp", layer)][:n]).abs().max() <= 1e-4
        assert (out.captures["attention_heads"][1].cpu() - cap[("attention_heads", 1)][:n]).abs().max() <= 1e-4
    assert llm.capture_status()["graph_replays"] > 0


def test_gpt2_bf16_greedy_matches_hf_and_graphs_match_eager(model_dirs):
    """GPT-2 in bfloat16 (fused residual + steering + LayerNorm, CUDA graphs): 16 greedy tokens equal
    HF's in bfloat16 on the same weights (up to near ties, ``_assert_bf16_greedy_close``), and graph
    replay equals eager with steering and capture."""
    path = model_dirs["gpt2"]
    prompts = PROMPTS[:4]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    steered = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                             steering_vectors=SteeringSpec(vectors={"post_attn": {1: _vec(5, 1.0)}},
                                                           clamps=[Clamp(2, _vec(6), hook="pre_attn", min=-0.5,
                                                                         max=0.5)]),
                             capture=CaptureSpec(layers=[0, 2], select="all_generated"))
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192, enforce_eager=eager)
        results[eager] = (llm.generate(prompts, plain, use_tqdm=False), llm.generate(prompts, steered, use_tqdm=False),
                          llm.llm_engine.stats()["graph_replays"])
        llm.shutdown()
    assert results[False][2] > 0 and results[True][2] == 0
    for a, b in zip(results[True][1], results[False][1]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, t in a.captures["hidden_states"].items():
            assert torch.equal(t, b.captures["hidden_states"][layer])
    _assert_bf16_greedy_close(path, results[False][0], 16)


def test_graph_replay_is_bit_identical_to_eager(model_dirs):
    """bf16, mixed batch with per-request adds, clamps and ablations, global steering and capture:
    graphs change nothing."""
    path = model_dirs["qwen3"]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(5, 60))] for _ in range(24)]
    params = []
    for i in range(24):
        kw = dict(max_tokens=20, temperature=0, ignore_eos=True)
        if i % 3 == 0:
            kw["steering_vectors"] = {"post_attn": {1: _vec(10 + i, 1.0)}}
        elif i % 3 == 1:
            kw["steering_vectors"] = SteeringSpec(clamps=[Clamp(1, _vec(40 + i), min=-0.5, max=0.5),
                                                          Clamp(2, _vec(70 + i), hook="pre_attn", min=0.0, max=0.0)])
        if i % 4 == 0:
            kw["capture"] = CaptureSpec(layers=[0, 2], select="all_generated")
        params.append(SamplingParams(**kw))
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=16384, enforce_eager=eager)
        llm.set_steering_vectors(SteeringSpec(vectors={"pre_attn": {2: _vec(99, 0.5)}},
                                              clamps=[Clamp(0, _vec(98), hook="post_attn", min=-1.0, max=1.0)]))
        llm.start_capture(layers=[1], select="all_generated")
        outs = llm.generate(prompts, params, use_tqdm=False)
        stream = llm.fetch_captured()
        results[eager] = (outs, stream, llm.capture_status())
    (eager_outs, eager_stream, _), (graph_outs, graph_stream, status) = results[True], results[False]
    assert status["graph_replays"] > 0
    for a, b in zip(eager_outs, graph_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, t in a.captures.get("hidden_states", {}).items():
            assert torch.equal(t, b.captures["hidden_states"][layer])
    assert torch.equal(eager_stream[0][1], graph_stream[0][1])
    assert eager_stream[1][1] == graph_stream[1][1]


@pytest.fixture(scope="module")
def gemma_shapes(tmp_path_factory):
    """Random bf16 Gemma 3 checkpoints of the 270M and 4B text models' shapes (benchmarks/common.py)."""
    from benchmarks import common

    root = tmp_path_factory.mktemp("gemma_shapes")
    return {shape: common.build_random_model(str(root / shape), *common.SHAPES[shape][:2])
            for shape in ("gemma3-270m", "gemma3-4b")}


@pytest.mark.parametrize("shape", ["gemma3-270m", "gemma3-4b"])
def test_gemma_graph_replay_equals_eager(gemma_shapes, shape):
    """bf16, 24 requests whose contexts outgrow the window (512 / 1024), per-request steering on a
    local and a global layer, captures: decode steps replayed from graphs give eager's tokens and
    rows bit for bit."""
    path = gemma_shapes[shape]
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 200000) for _ in range(rng.randrange(300, 1400))] for _ in range(24)]
    hidden = 640 if shape == "gemma3-270m" else 2560
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=65536, enforce_eager=eager)
        params = []
        for i in range(24):
            kw = dict(max_tokens=40, temperature=0, ignore_eos=True)
            if i % 3 == 0:
                vec = (torch.randn(hidden, generator=torch.Generator().manual_seed(i)) * 2).tolist()
                kw["steering_vectors"] = {"post_attn": {4: vec}, "post_mlp": {5: vec}}
            if i % 4 == 0:
                kw["capture"] = CaptureSpec(layers=[0, 5], select="all_generated")
            params.append(SamplingParams(**kw))
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = (outs, llm.llm_engine.stats())
    (eager_outs, _), (graph_outs, stats) = results[True], results[False]
    assert stats["graph_replays"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    for a, b in zip(eager_outs, graph_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, t in a.captures.get("hidden_states", {}).items():
            assert torch.equal(t, b.captures["hidden_states"][layer])


def test_gpu_kv_cache_sized_from_free_memory(model_dirs):
    llm = LLM(model_dirs["llama"], dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    kv_bytes = llm.llm_engine.stats()["kv_cache_bytes"]
    assert 0.1 * total < kv_bytes < 0.3 * total
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_qwen3_moe_decodes_from_cuda_graphs(tmp_path):
    """Expert dispatch has static shapes: decode replays CUDA graphs (router-logit capture and
    steering inside), fp32 greedy equals HF, and bf16 replay equals eager bit for bit."""
    from test_qwen3_moe import build_qwen3_moe

    path = str(tmp_path / "moe")
    build_qwen3_moe(path, seed=3, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192)
    hf = hf_model(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 12)
    assert llm.llm_engine.stats()["graph_replays"] > 0
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            steering_vectors=SteeringSpec(vectors={"post_attn": {0: _vec(5, 1.0)}},
                                                          clamps=[Clamp(2, _vec(6), min=-0.5, max=0.5)]),
                            capture=CaptureSpec("router_logits", select="all_generated"))
    results = {}
    for eager in (True, False):
        engine = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192, enforce_eager=eager)
        results[eager] = engine.generate(PROMPTS, params, use_tqdm=False)
        assert (engine.llm_engine.stats()["graph_replays"] > 0) == (not eager)
    for a, b in zip(results[True], results[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, rows in a.captures["router_logits"].items():
            assert torch.equal(rows, b.captures["router_logits"][layer])


def test_graphs_are_captured_inside_llm_construction(model_dirs):
    """LLM(...) compiles and captures every decode graph size (sampling inside the graph, outside it
    for top-p, and sharing a prefix where the batch is past the split-KV limit) and every mixed size
    (sharing a prefix or not); the first generate, whose chats share a system prompt and join running
    ones, captures nothing."""
    from steerable.layers.attention_backends.shared_prefix import shares

    llm = LLM(model_dirs["qwen3"], dtype="bfloat16", device="cuda", kv_cache_tokens=16384, max_num_seqs=80,
              shared_prefix_min_tokens=32, shared_prefix_min_requests=2)
    stats = llm.llm_engine.stats()
    runner = llm.llm_engine.worker
    graphs = runner.graphs

    def decode_shares(size: int) -> bool:
        return size >= 2 and shares(size, runner.attention_layers[0].num_kv_heads, 1, runner.workspace)

    assert decode_shares(80) and not decode_shares(64)  # 2 KV heads: both sides of the limit on the ladder
    keys = set(graphs.graphs)
    assert {(k[0], k[3], k[4]) for k in keys if not k[5]} == {
        (size, inside, shared) for size in graphs.sizes for inside in (True, False) for shared in (False, True)
        if decode_shares(size) or not shared}
    assert {(k[0], k[4]) for k in keys if k[5]} == {(size, shared) for size in graphs.mixed_sizes
                                                    for shared in (False, True) if size <= 80 * 128}
    assert stats["graph_captures"] == len(keys) and stats["graph_replays"] == 0
    # 72 chats, over one step's 8,192 tokens of prefill: the second generate finds them all in the prefix
    # cache, and its decode steps of 65+ rows (padded to 80, past the split-KV limit) and a mixed step
    # share (on a CPU under the interpreter, with the graph runner's padding: 4 such steps).
    system = [11] * 96
    prompts = [system + [7 + i] * (5 + 2 * (i % 33)) for i in range(72)]
    for top_p in (1.0, 0.8):
        params = [SamplingParams(max_tokens=4 + i % 9, temperature=0.7, top_p=top_p, ignore_eos=True) for i in range(72)]
        llm.generate(prompts, params, use_tqdm=False)
    after = llm.llm_engine.stats()
    assert after["graph_captures"] == len(keys) and after["graph_replays"] > 0 and after["shared_prefix_steps"] > 0
    eager = LLM(model_dirs["qwen3"], dtype="bfloat16", device="cuda", kv_cache_tokens=16384, enforce_eager=True)
    assert eager.llm_engine.stats()["graph_captures"] == 0


def test_fp8_kv_cache_on_gpu(capture_dirs):
    """fp8 KV through the Triton kernels: graph replay equals eager with steering and capture inside,
    and the next token agrees with a bf16 cache (teacher-forced, tiny random model)."""
    from test_fp8_kv import teacher_forced_agreement

    path = capture_dirs["qwen3"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            steering_vectors=SteeringSpec(vectors={"post_mlp": {0: _vec(1, 0.5)}},
                                                          clamps=[Clamp(1, _vec(2), min=-0.5, max=0.5)]),
                            capture=CaptureSpec(layers=[1], select="all_generated"))
    runs = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192, kv_cache_dtype="fp8",
                  enforce_eager=eager)
        assert llm.llm_engine.worker.kv_cache.dtype == torch.float8_e4m3fn
        v_cache = llm.llm_engine.worker.attention_layers[0].v_cache
        assert v_cache.stride(1) == 1 and v_cache.stride(3) == v_cache.shape[1]  # position-major V
        runs[eager] = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.equal(a.captures["hidden_states"][1], b.captures["hidden_states"][1])
    bf16 = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192)
    prompt = bf16.get_tokenizer()(PROMPTS[3]).input_ids
    assert teacher_forced_agreement(bf16, llm, prompt, 64) >= 0.9


def test_a_slow_threaded_sink_reads_rows_before_their_host_block_is_reused(capture_dirs):
    """The device-to-host copies rotate over three host blocks; a sink that takes its rows on the
    sink thread, slower than the engine steps, must still read every step's own rows (prefill
    chunks eagerly, decode steps from CUDA graphs), equal to a stored stream's."""
    import threading
    import time

    class SlowSink:
        threaded = True

        def __init__(self):
            self.parts, self.threads = [], set()

        def append(self, rows):
            self.threads.add(threading.current_thread().name)
            time.sleep(0.02)
            self.parts.append(rows.block.index_select(1, torch.from_numpy(rows.where)).clone())

    llm = LLM(capture_dirs["llama"], dtype="float32", device="cuda", kv_cache_tokens=8192, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sink = SlowSink()
    llm.llm_engine.start_capture("hidden_states", [0, 2], None, "all", "all", None, "post_mlp", sink=sink)
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    llm.stop_capture()
    llm.start_capture(layers=[0, 2], select="all")
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    llm.stop_capture()
    stored, _ = llm.fetch_captured()
    received = torch.cat(sink.parts, dim=1)
    assert sink.threads == {"capture-sink_0"} and len(sink.parts) > 6
    assert llm.llm_engine.stats()["graph_replays"] > 0
    assert torch.equal(received[0], stored[0]) and torch.equal(received[1], stored[2])


def test_gemma2_bf16_greedy_matches_hf(model_dirs):
    """Gemma 2 in bfloat16 (soft-capped Triton attention, CUDA graphs) against HF in bfloat16 on the
    same random weights: 16 greedy tokens for every prompt, up to near ties (``_assert_bf16_greedy_close``)."""
    path = model_dirs["gemma2"]
    llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=8192)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.stats()["graph_replays"] > 0
    _assert_bf16_greedy_close(path, outs, 16)


def test_gemma2_graph_replay_equals_eager(model_dirs):
    """bf16 Gemma 2 (soft-caps in the attention kernel, window 8 outgrown by every prompt), steering
    on a local and a global layer and captures: graph replays give eager's tokens and rows bit for bit."""
    path = model_dirs["gemma2"]
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(12, 80))] for _ in range(16)]
    params = []
    for i in range(16):
        kw = dict(max_tokens=24, temperature=0, ignore_eos=True)
        if i % 3 == 0:
            kw["steering_vectors"] = {"post_attn": {0: _vec(i, 1.0)}, "post_mlp": {1: _vec(50 + i, 1.0)}}
        elif i % 3 == 1:
            kw["steering_vectors"] = SteeringSpec(clamps=[Clamp(2, _vec(80 + i), min=-0.5, max=0.5)])
        if i % 4 == 0:
            kw["capture"] = CaptureSpec(layers=[0, 3], select="all_generated")
        params.append(SamplingParams(**kw))
    results = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=16384, enforce_eager=eager)
        results[eager] = (llm.generate(prompts, params, use_tqdm=False), llm.llm_engine.stats())
    (eager_outs, _), (graph_outs, stats) = results[True], results[False]
    assert stats["graph_replays"] > 0
    for a, b in zip(eager_outs, graph_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, t in a.captures.get("hidden_states", {}).items():
            assert torch.equal(t, b.captures["hidden_states"][layer])


def test_structured_outputs_mask_after_the_graph(model_dirs):
    """Constrained decode steps keep replaying the forward's CUDA graph (the grammar mask is
    applied to the logits it returns), the constraints hold, and unconstrained requests beside
    them equal their run alone."""
    import re

    pytest.importorskip("xgrammar")
    llm = LLM(model_dirs["qwen3"], dtype="bfloat16", device="cuda", kv_cache_tokens=8192)
    regex, choices = r"[a-z]{2,5}( [a-z]{2,5}){1,3}", ["alpha beta", "gamma delta epsilon"]
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
    before = llm.llm_engine.stats()["graph_replays"]
    params = [free, SamplingParams(max_tokens=24, temperature=0, structured_outputs={"regex": regex}), free,
              SamplingParams(max_tokens=24, temperature=0.8, seed=1, structured_outputs={"choice": choices})]
    outs = [o.outputs[0] for o in llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[4]], params,
                                               use_tqdm=False)]
    assert llm.llm_engine.stats()["graph_replays"] > before
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    assert re.fullmatch(regex, outs[1].text) and outs[3].text in choices


def test_patterns_and_sae_features_on_gpu(capture_dirs):
    """On CUDA in float32, with graphs on: attention patterns (eager steps), SAE features (decode
    rows inside the graphs) and hidden states in the same steps, their row indices staged together
    from pinned memory, equal HF eager on the CPU (patterns, states) and the SAE's reference math."""
    llm = check_patterns_and_features(capture_dirs["llama"], "cuda")
    assert llm.llm_engine.stats()["graph_replays"] > 0


def check_patterns_and_features(path: str, device: str) -> LLM:
    """Four requests in one batch, each with another capture kind; every row checked against HF."""
    from test_capture_patterns import hf_patterns
    from test_sae_capture import assert_features_match, hf_point, random_sae, reference

    from steerable.capture import ATTENTION_PATTERNS

    hf = hf_model(path)
    llm = LLM(path, dtype="float32", device=device, kv_cache_tokens=8192, max_num_batched_tokens=32)
    sae = random_sae(llm.engine.model_config.hidden_size, "jumprelu", 1)
    llm.register_sae("res1", sae)
    kinds = [("patterns", [0, 2], None, "all"), ("sae", [1], None, "all"), ("patterns", [1], [3, 0], "last_prompt"),
             ("states", [0, 1], None, "all_generated")]
    specs = [CaptureSpec(stream=ATTENTION_PATTERNS, layers=layers, heads=heads, select=select) if kind == "patterns"
             else CaptureSpec(stream="sae_features", saes=["res1"], top_k=8, select=select) if kind == "sae"
             else CaptureSpec(layers=layers, select=select) for kind, layers, heads, select in kinds]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=s) for s in specs]
    outs = llm.generate([PROMPTS[1], PROMPTS[5], PROMPTS[2], PROMPTS[3]], params, use_tqdm=False)
    for out, (kind, layers, heads, select) in zip(outs, kinds):
        prompt_len = len(out.prompt_token_ids)
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 6)
        if kind == "patterns":
            ref = hf_patterns(hf, ids[:-1], prompt_len)
            for layer in layers:
                pat, meta = out.captures[ATTENTION_PATTERNS][layer], out.capture_meta[ATTENTION_PATTERNS][layer]
                want = list(range(len(ids) - 1)) if select == "all" else [prompt_len - 1]
                assert meta.positions.tolist() == want and pat.heads == sorted(heads or range(ref[layer].shape[0]))
                for row, p in zip(pat.rows, want):
                    assert (row - ref[layer][pat.heads, p, :p + 1]).abs().max() <= 1e-4
        elif kind == "sae":
            assert out.capture_meta["sae_features"]["res1"].positions.tolist() == list(range(len(ids) - 1))
            assert_features_match(out.captures["sae_features"]["res1"],
                                  reference(sae, hf_point(hf, ids[:-1], 1, "post_mlp"), 8))
        else:
            with torch.no_grad():
                states = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
            for layer in layers:
                got = out.captures["hidden_states"][layer].cpu()
                assert got.shape[0] == len(ids) - 1 - prompt_len > 0
                assert (got - states[layer + 1][0, prompt_len:]).abs().max() <= 1e-4
    return llm
