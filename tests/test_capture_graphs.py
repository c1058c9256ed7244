"""Capture keeps what plain requests get (issue 47): on a chat-shaped workload (chats sharing a
system prompt, new chats joining running ones), requests capturing their last prompt token run the
same steps as plain ones: every step that would replay a CUDA graph without capture still does
(mixed steps included, with the capture plan in the key), every prefix-cache hit stands, and the
step builder finds the same shared prefixes. The graph runner's decisions are taken on a CPU with
``graph_harness.EagerGraphs``, which pads each step as a replay would and runs it; the captured
rows equal an engine without graphs, one row per request and layer, labelled."""

from __future__ import annotations

import pytest
import torch
from graph_harness import install

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.capture import match_capture_request_id
from steerable.engine.shared_prefix import SharedPrefixDetector

SYSTEM = list(range(5, 45))  # 40 tokens: two whole blocks of 16 shared
USERS = (3, 9, 5, 12, 2, 7, 4, 10)
OUTPUTS = (6, 3, 8, 4, 7, 2, 5, 6)
MAX_MIXED = 256


def _engine(path: str) -> LLM:
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=2048, max_num_seqs=4,
              max_num_batched_tokens=MAX_MIXED)
    # The detector a Triton engine gets (the CPU's torch attention ignores it): which steps share.
    llm.llm_engine.builder.shared_prefix = (0, SharedPrefixDetector(16, 16, 2))
    return llm


def _chats(salt: str, capture=None) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [SYSTEM + list(range(60 + i, 60 + i + n)) for i, n in enumerate(USERS)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, cache_salt=salt, capture=capture)
              for m in OUTPUTS]
    return prompts, params


MODES = {
    "plain": None,
    "every_layer": CaptureSpec(layers=None, select="last_prompt"),
    "one_layer": CaptureSpec(layers=[1], select="last_prompt"),
    "stream": "stream",
}


@pytest.fixture(scope="module")
def runs(model_dirs):
    """Per mode: the outputs, each step's (graph key without the capture plan, shares a prefix,
    has a capture plan, mixed), the stats' deltas and the stream's rows; then the outputs of an
    engine without graphs capturing the same rows."""
    llm = _engine(model_dirs["qwen3"])
    seen = install(llm, MAX_MIXED)
    engine = llm.llm_engine
    results = {}
    for mode, capture in MODES.items():
        seen.clear()
        before = engine.stats()
        if capture == "stream":
            llm.start_capture(layers=None, select="last_prompt")
        outs = llm.generate(*_chats(mode, capture if capture != "stream" else None), use_tqdm=False)
        stream = None
        if capture == "stream":
            llm.stop_capture()
            stream = llm.fetch_captured()
        after = engine.stats()
        steps = [(None if key is None else key[:2] + key[3:], step.shared_prefix is not None,
                  step.capture is not None, step.max_query_len > 1) for key, step in seen]
        results[mode] = dict(outs=outs, steps=steps, stream=stream,
                             stats={k: after[k] - before[k] for k in ("num_steps", "prefix_cache_hit_tokens",
                                                                       "prefix_cache_query_tokens")})
    llm.shutdown()
    eager = _engine(model_dirs["qwen3"])
    results["eager"] = eager.generate(*_chats("eager", MODES["every_layer"]), use_tqdm=False)
    eager.shutdown()
    return results


def test_capture_keeps_graphs_prefix_hits_and_shared_prefixes(runs):
    plain = runs["plain"]
    assert plain["stats"]["prefix_cache_hit_tokens"] > 0
    assert any(mixed and key is not None for key, _, _, mixed in plain["steps"])  # the workload has graphed mixed steps
    assert any(shared for _, shared, _, _ in plain["steps"])
    for mode in ("every_layer", "one_layer", "stream"):
        run = runs[mode]
        assert run["stats"] == plain["stats"], mode
        # Step for step the same graph (padded shape, steering, sampling inside, sharing, mixed) and the same groups.
        assert [s[:2] for s in run["steps"]] == [s[:2] for s in plain["steps"]], mode
        graphed_captures = [mixed for key, _, captures, mixed in run["steps"] if captures and key is not None]
        assert graphed_captures and all(graphed_captures), mode  # last-prompt rows come in mixed steps, graphed
        for got, want in zip(run["outs"], plain["outs"]):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_graphed_capture_rows_equal_eager_and_are_labelled(runs):
    for out, reference in zip(runs["every_layer"]["outs"], runs["eager"]):
        rows, metas = out.captures["hidden_states"], out.capture_meta["hidden_states"]
        assert sorted(rows) == [0, 1, 2]
        P = len(out.prompt_token_ids)
        for layer, tensor in rows.items():
            assert tensor.shape == (1, 64)
            assert metas[layer].positions.tolist() == [P - 1]
            assert metas[layer].token_ids.tolist() == [out.prompt_token_ids[-1]]
            assert match_capture_request_id(metas[layer].req_ids[0], out.request_id)
            assert torch.equal(tensor, reference.captures["hidden_states"][layer])
    for out, reference in zip(runs["one_layer"]["outs"], runs["eager"]):
        assert list(out.captures["hidden_states"]) == [1]
        assert torch.equal(out.captures["hidden_states"][1], reference.captures["hidden_states"][1])
    tensors, metas = runs["stream"]["stream"]
    outs = runs["stream"]["outs"]
    assert len(metas[0]) == len(outs)  # one row per request: none lost to a hit, none twice
    for layer in (0, 1, 2):
        for out, reference in zip(outs, runs["eager"]):
            i = next(i for i, r in enumerate(metas[layer].req_ids) if match_capture_request_id(r, out.request_id))
            assert metas[layer].positions[i].item() == len(out.prompt_token_ids) - 1
            assert torch.equal(tensors[layer][i], reference.captures["hidden_states"][layer][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_capture_steps_replay_graphs_on_gpu(model_dirs):
    """bf16 chats on one system prompt joining running ones, each capturing its last prompt row at
    every layer (and some every prompt row, and a stream every generated row): no step runs eagerly
    for capture, the rows equal an eager engine's bit for bit, and the graphs' capture blocks share
    one slab per group instead of one block per graph."""
    system = [11] * 48
    prompts = [system + [7 + i] * (3 + i % 11) for i in range(40)]
    params = [SamplingParams(max_tokens=3 + i % 7, temperature=0, ignore_eos=True,
                             capture=CaptureSpec(layers=None, select="all_prompt" if i % 5 == 0 else "last_prompt"))
              for i in range(40)]
    results = {}
    for eager in (True, False):
        llm = LLM(model_dirs["qwen3"], dtype="bfloat16", device="cuda", kv_cache_tokens=16384, max_num_seqs=8,
                  enforce_eager=eager)
        llm.start_capture(layers=[1], select="all_generated")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = (outs, llm.fetch_captured(), llm.capture_status(), llm.llm_engine.worker.graphs)
        llm.shutdown()
    (eager_outs, eager_stream, _, _), (outs, stream, status, graphs) = results[True], results[False]
    assert status["eager_capture_forwards"] == 0 and status["graph_replays"] > 0
    assert any(key[2] is not None and key[5] for key in graphs.graphs)  # mixed graphs with a capture plan
    for a, b in zip(eager_outs, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, t in a.captures["hidden_states"].items():
            assert torch.equal(t, b.captures["hidden_states"][layer])
            assert a.capture_meta["hidden_states"][layer] == b.capture_meta["hidden_states"][layer]
    assert torch.equal(eager_stream[0][1], stream[0][1]) and eager_stream[1][1] == stream[1][1]
    storages, largest = {}, {}
    capturing = [g for g in graphs.graphs.values() if any(block is not None for block in g.staged)]
    for g in capturing:
        for position, block in enumerate(g.staged):
            if block is not None:
                storage = block.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
                largest[position] = max(largest.get(position, 0), block.nbytes)
    # A slab per group position, grown by doubling (at most 4x its largest block, old slabs included),
    # not a block per graph.
    assert sum(storages.values()) <= 4 * sum(largest.values())
    assert sum(storages.values()) < sum(block.nbytes for g in capturing for block in g.staged if block is not None)
