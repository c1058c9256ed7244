"""SAE feature capture (the ``sae_features`` component): features equal the reference math on HF
hidden states at the SAE's point, for prompt and generated rows, under chunked prefill, prefix
caching and preemption; labels exact, each row once; streams, the wire form, sparse corpus
shards and bad input."""

import pytest
import torch
from conftest import PROMPTS, hf_model
from safetensors.torch import load_file

from steerable import SAE, LLM, CaptureSpec, SamplingParams
from steerable.capture import deserialize_captured
from steerable.capture.corpus import capture_corpus
from steerable.capture.serialization import serialize_captured
from steerable.capture.sparse import SparseFeatures

TOP_K = 8


def random_sae(d_in: int, architecture: str, layer: int, hook: str = "post_mlp", seed: int = 0, d_sae: int = 96) -> SAE:
    g = torch.Generator().manual_seed(seed)
    kw = {"threshold": torch.rand(d_sae, generator=g) * 0.2} if architecture == "jumprelu" else {}
    if architecture == "topk":
        kw["k"] = 5
    return SAE(torch.randn(d_in, d_sae, generator=g) * 0.5, torch.randn(d_sae, generator=g) * 0.1,
               torch.randn(d_sae, d_in, generator=g), torch.randn(d_in, generator=g) * 0.1, architecture,
               apply_b_dec_to_input=architecture != "relu", layer=layer, hook=hook, **kw)


def reference(sae: SAE, x: torch.Tensor, top_k: int) -> SparseFeatures:
    values, indices = sae.encode(x).topk(top_k, dim=-1)
    active = values > 0
    return SparseFeatures(torch.where(active, indices, -1).int(), torch.where(active, values, 0.0))


def assert_features_match(ours: SparseFeatures, ref: SparseFeatures) -> None:
    assert ours.indices.dtype == torch.int32 and ours.values.dtype == torch.float32
    assert torch.allclose(ours.values, ref.values, atol=1e-4), (ours.values - ref.values).abs().max()
    # Indices must agree wherever the ranking is not a near tie.
    gaps = (ref.values[:, :-1] - ref.values[:, 1:]).abs()
    clear = torch.cat([gaps[:, :1], torch.minimum(gaps[:, 1:], gaps[:, :-1])], 1) > 1e-4 if gaps.shape[1] > 1 else None
    sure = torch.ones_like(ref.indices, dtype=torch.bool)
    if clear is not None:
        sure[:, :-1] &= clear
        sure[:, -1] &= gaps[:, -1] > 1e-4
    assert torch.equal(ours.indices[sure], ref.indices[sure])
    assert (ref.values > 0).any(), "no active feature: the check would pass a no-op"


def hf_point(hf, ids: list[int], layer: int, hook: str) -> torch.Tensor:
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
    return states[layer + 1][0] if hook == "post_mlp" else states[layer][0]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def family(request, capture_dirs):
    path = capture_dirs[request.param]
    return LLM(path, device="cpu", kv_cache_tokens=8192), hf_model(path)


def test_features_equal_reference_on_hf_states(family):
    llm, hf = family
    d = llm.engine.model_config.hidden_size
    saes = {"res1": random_sae(d, "jumprelu", 1), "pre0": random_sae(d, "topk", 0, "pre_attn", seed=1),
            "res0": random_sae(d, "relu", 0, seed=2)}
    for name, sae in saes.items():
        llm.register_sae(name, sae)
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                capture=CaptureSpec(stream="sae_features", saes=list(saes), top_k=TOP_K, select="all"))
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        for out in outs:
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            for name, sae in saes.items():
                ours = out.captures["sae_features"][name]
                meta = out.capture_meta["sae_features"][name]
                assert meta.positions.tolist() == list(range(len(ids) - 1))  # prompt and generated rows, once
                assert meta.token_ids.tolist() == ids[:-1]
                assert set(meta.req_ids) == {meta.req_ids[0]} and meta.req_ids[0].startswith(out.request_id)
                assert_features_match(ours, reference(sae, hf_point(hf, ids, sae.layer, sae.hook)[:-1], TOP_K))
                if sae.architecture == "topk":  # k = 5 < top_k: the rest is padding
                    assert (ours.indices[:, 5:] == -1).all() and (ours.values[:, 5:] == 0).all()
    finally:
        for name in saes:
            llm.unregister_sae(name)


def test_chunked_prefill_prefix_cache_preemption(capture_dirs):
    path = capture_dirs["qwen3"]
    hf = hf_model(path)
    # A small token budget chunks the prompts; a small KV cache preempts; the repeated prompt hits the cache.
    llm = LLM(path, device="cpu", kv_cache_tokens=160, max_num_batched_tokens=16, block_size=4,
              enable_prefix_caching=True)
    sae = random_sae(llm.engine.model_config.hidden_size, "jumprelu", 1)
    llm.register_sae("res1", sae)
    llm.generate(PROMPTS[3], SamplingParams(max_tokens=1), use_tqdm=False)  # its prompt blocks are cached now
    prompts = [PROMPTS[3], PROMPTS[5], PROMPTS[3], PROMPTS[7]]
    specs = ["all_generated", "all", "all", {"prompt_positions": [-1], "generation": "all"}]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 capture=CaptureSpec(stream="sae_features", saes=["res1"],
                                                                     top_k=TOP_K, select=s)) for s in specs],
                        use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0 and llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    for out, select in zip(outs, specs):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        P = len(out.prompt_token_ids)
        meta = out.capture_meta["sae_features"]["res1"]
        expected = {"all": list(range(len(ids) - 1)), "all_generated": list(range(P, len(ids) - 1))}.get(
            select if isinstance(select, str) else "", [P - 1, *range(P, len(ids) - 1)])
        assert meta.positions.tolist() == expected
        rows = hf_point(hf, ids, 1, "post_mlp")[torch.tensor(expected)]
        assert_features_match(out.captures["sae_features"]["res1"], reference(sae, rows, TOP_K))


def test_stream_fetch_wire_and_one_shot(family):
    llm, hf = family
    sae = random_sae(llm.engine.model_config.hidden_size, "jumprelu", 1)
    llm.register_sae("res1", sae)
    try:
        llm.start_capture("sae_features", saes=["res1"], top_k=TOP_K, select="all")
        with pytest.raises(ValueError, match="name: SAE 'res1' is in use"):
            llm.unregister_sae("res1")
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        llm.stop_capture("sae_features")
        tensors, metas = llm.fetch_captured("sae_features")
        assert list(tensors) == ["res1"] and len(tensors["res1"]) == len(metas["res1"])
        rows = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        assert len(metas["res1"]) == rows
        wire = serialize_captured(tensors, metas, text=True)
        back, back_meta = deserialize_captured(wire)
        assert back["res1"] == tensors["res1"] and back_meta["res1"] == metas["res1"]
        result = __import__("steerable").capture(llm, PROMPTS[:2], stream="sae_features", saes=["res1"],
                                                 top_k=TOP_K, select="all", max_tokens=3)
        ref = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
        assert_features_match(result.sample(0)["res1"], reference(sae, hf_point(hf, ref, 1, "post_mlp")[:-1], TOP_K))
        assert len(result.rows("res1")) == rows
    finally:
        llm.unregister_sae("res1")


def test_sparse_corpus_shards(capture_dirs, tmp_path):
    llm = LLM(capture_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    sae = random_sae(llm.engine.model_config.hidden_size, "jumprelu", 1)
    llm.register_sae("res1", sae)
    index = capture_corpus(llm, PROMPTS[:5], tmp_path / "out", select="all", shard_size=2, sae="res1", top_k=TOP_K)
    assert index["complete"] and index["top_k"] == TOP_K and len(index["shards"]) == 3
    shard = load_file(str(tmp_path / "out" / "shard-00000.safetensors"))
    assert shard["indices"].dtype == torch.int32 and shard["values"].shape == (shard["indices"].shape[0], TOP_K)
    offline = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, capture=CaptureSpec(
        stream="sae_features", saes=["res1"], top_k=TOP_K, select="all")), use_tqdm=False)[0]
    n = len(offline.prompt_token_ids)
    assert torch.equal(shard["indices"][:n], offline.captures["sae_features"]["res1"].indices)
    # A corpus batch and a request alone run the CPU GEMMs with different row counts, whose float32
    # rounding may differ in the last bits (seen: 7e-7), so values match to 1e-5, indices exactly.
    torch.testing.assert_close(shard["values"][:n], offline.captures["sae_features"]["res1"].values, atol=1e-5, rtol=0)
    assert shard["example"][:n].tolist() == [0] * n and shard["position"][:n].tolist() == list(range(n))


def test_capture_cli_with_an_sae(capture_dirs, tmp_path):
    """``steerable capture --sae PATH --top-k K``: sparse shards equal ``steerable.capture``'s
    features with their labels; an SAE file that does not load fails before the model does."""
    import json

    from test_sae_registry import save_saelens

    import steerable
    from steerable.entrypoints.cli import main

    path = save_saelens(random_sae(64, "topk", 1, "pre_attn", seed=4), tmp_path / "sae")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS[:3]))
    args = ["capture", "--model", capture_dirs["qwen3"], "--device", "cpu", "--kv-cache-tokens", "2048",
            "--input", str(texts), "--select", "all_prompt", "--top-k", str(TOP_K)]
    assert main([*args, "--sae", path, "--out", str(tmp_path / "out")]) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["complete"] and index["top_k"] == TOP_K and (index["layers"], index["hook"]) == ([1], "pre_attn")
    shard = load_file(str(tmp_path / "out" / "shard-00000.safetensors"))
    llm = LLM(capture_dirs["qwen3"], device="cpu", kv_cache_tokens=2048)
    llm.register_sae("s", SAE.load(path))
    ref = steerable.capture(llm, PROMPTS[:3], stream="sae_features", saes=["s"], top_k=TOP_K, select="all_prompt")
    assert SparseFeatures(shard["indices"], shard["values"]) == ref.rows("s")
    assert shard["position"].tolist() == ref.meta("s").positions.tolist()
    assert shard["token_id"].tolist() == ref.meta("s").token_ids.tolist()
    assert shard["example"].tolist() == [i for i, p in enumerate(PROMPTS[:3]) for _ in llm.get_tokenizer()(p).input_ids]
    assert (shard["indices"][:, :5] >= 0).all()  # topk k=5: five features on every row
    assert main([*args, "--sae", str(tmp_path / "nowhere"), "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_bad_input(family):
    llm, _ = family
    sae = random_sae(llm.engine.model_config.hidden_size, "jumprelu", 1, d_sae=32)
    llm.register_sae("res1", sae)
    try:
        for kw, field in [({"saes": ["nope"]}, "capture.saes"), ({"saes": ["res1"], "top_k": 0}, "capture.top_k"),
                          ({"saes": ["res1"], "top_k": 33}, "capture.top_k"), ({"saes": []}, "capture.saes"),
                          ({"saes": ["res1"], "reduce": "mean"}, "capture.reduce")]:
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.generate("Hello", SamplingParams(max_tokens=1, capture=CaptureSpec(stream="sae_features", **kw)),
                             use_tqdm=False)
        for kw, field in [({"saes": ["res1"], "top_k": -1}, "top_k"), ({"saes": ["res1"], "top_k": 33}, "top_k"),
                          ({"saes": ["nope"]}, "saes"), ({"saes": []}, "saes")]:
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.start_capture("sae_features", **kw)
        assert llm.engine.capture.features.in_use("res1") is None  # nothing leaked
        assert not llm.engine.requests and not llm.capture_status("sae_features")["enabled"]
        assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.unregister_sae("res1")
