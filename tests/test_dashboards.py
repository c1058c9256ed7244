"""Feature dashboards in one pass: every field equals the brute-force reference on HF hidden states
and the SAE's reference encoder (``dashboard_reference``), whatever the batch size, chunked
prefill, encode chunking, long-text pieces or shards; the grid and merges are exact on their own;
resumed runs equal whole ones; bad input names its field."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
import torch
from conftest import CORPUS, hf_model
from dashboard_reference import ambiguous, hf_points, reference, reference_logits

from steerable import LLM, SAE, feature_dashboards
from steerable.sae.dashboards import grid, plan, run_shards
from steerable.sae.dashboards.driver import empty_state
from steerable.sae.dashboards.grid import bin_index, grid_exponent, regrid, sample_keys
from steerable.sae.dashboards.merge import Places, descending, merge_rows, pack, reservoir_order, top_order

ARGS = dict(n_top=6, context=(5, 3), quantiles=4, n_quantile=3, n_logits=7, bins=12, seed=11)
D_SAE = 40
MARGIN = 3e-5  # engine vs HF activations differ by ~1e-6


def corpus(n: int, tokenize, seed: int = 0) -> list[str]:
    """Texts of 5 to 60 words from the tokenizer's sentences, each starting with a token of its own:
    no two texts share a prefix, so no two activations tie exactly (a tie between equal contexts
    would be broken by float32 noise, differently in differently batched runs)."""
    rng = random.Random(seed)
    words = " ".join(CORPUS[:7]).split()
    texts: list[str] = []
    firsts: set[int] = set()
    while len(texts) < n:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        first = tokenize(text)[0]
        if first not in firsts:
            firsts.add(first)
            texts.append(text)
    return texts


def random_sae(d_in: int, architecture: str, layer: int, hook: str, seed: int) -> SAE:
    g = torch.Generator().manual_seed(seed)
    kw = {"threshold": 0.1 + torch.rand(D_SAE, generator=g) * 0.3} if architecture == "jumprelu" else {}
    if architecture == "topk":
        kw["k"] = 6
    return SAE(torch.randn(d_in, D_SAE, generator=g) * 0.4, torch.randn(D_SAE, generator=g) * 0.3 - 0.4,
               torch.nn.functional.normalize(torch.randn(D_SAE, d_in, generator=g), dim=1),
               torch.randn(d_in, generator=g) * 0.1, architecture, apply_b_dec_to_input=True, layer=layer,
               hook=hook, **kw)


def unambiguous(sae: SAE, points: list[torch.Tensor]) -> SAE:
    """``sae`` with each feature's bias moved until no activation on the corpus sits near a decision
    (see ``dashboard_reference.ambiguous``), so float32 noise cannot flip an exact comparison."""
    x = torch.cat(points).double() - sae.b_dec.double()
    threshold = (sae.threshold.double() if sae.threshold is not None else torch.zeros(sae.d_sae, dtype=torch.double))
    b_enc = sae.b_enc.clone()
    for f in range(sae.d_sae):
        base = float(b_enc[f])
        for step in range(200):
            b_enc[f] = base + 0.0037 * (step // 2 + 1) * (-1) ** step if step else base
            pre = x @ sae.W_enc.double()[:, f:f + 1] + float(b_enc[f])
            if not ambiguous(pre, threshold[f:f + 1], 0, ARGS["n_top"], [ARGS["bins"], ARGS["quantiles"]], MARGIN):
                break
        else:
            raise AssertionError(f"feature {f}: no unambiguous bias found")
    return SAE(sae.W_enc, b_enc, sae.W_dec, sae.b_dec, sae.architecture, threshold=sae.threshold, k=sae.k,
               apply_b_dec_to_input=sae.apply_b_dec_to_input, layer=sae.layer, hook=sae.hook)


@pytest.fixture(scope="module")
def setup(capture_dirs):
    path = capture_dirs["qwen3"]
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    hf = hf_model(path)
    texts = corpus(24, llm.llm_engine.tokenize)
    ids = [llm.llm_engine.tokenize(t) for t in texts]
    d = llm.llm_engine.model_config.hidden_size
    sae = random_sae(d, "jumprelu", 1, "post_mlp", seed=3)
    points = hf_points(hf, ids, sae.layer, sae.hook)
    sae = unambiguous(sae, points)
    llm.register_sae("res1", sae)
    ref = reference([sae.encode(p) for p in points], ids, list(range(D_SAE)), ARGS["n_top"], *ARGS["context"],
                    ARGS["quantiles"], ARGS["n_quantile"], ARGS["bins"], ARGS["seed"])
    logits = reference_logits(hf, sae, list(range(D_SAE)), ARGS["n_logits"], unit_offset=False)
    return llm, texts, sae, ref, logits, path


def assert_examples(ours, ref, tol=1e-5):
    """Same examples in the same order; values within ``tol`` relative to max(1, |value|) (float32
    from the engine's kernels against HF's: another reduction order moves a value of 10 by 1e-5)."""
    assert [(e.corpus_index, e.position) for e in ours] == [(r.corpus_index, r.position) for r in ref]
    for e, r in zip(ours, ref):
        assert e.tokens == r.tokens and len(e.token_strs) == len(e.tokens)
        assert abs(e.max - r.value) <= tol * max(1.0, abs(r.value)) and e.activations[e.offset] == e.max
        assert all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(e.activations, r.window) if b == b)
        assert [a != a for a in e.activations] == [b != b for b in r.window]  # NaN outside the text, alike


def assert_matches_reference(dash, ref, logits, features=None):
    features = list(range(D_SAE)) if features is None else features
    assert dash.features == features
    active = 0
    for f in features:
        ours, r = dash[f], ref[f]
        assert (ours.tokens, ours.count) == (r["tokens"], r["count"]), f
        assert ours.density == r["count"] / r["tokens"]
        assert abs(ours.max - r["max"]) <= 1e-5 and abs(ours.mean - r["mean"]) <= 1e-5
        assert_examples(ours.top, r["top"])
        top_ids, top_values, bottom_ids, bottom_values = logits[f]
        assert [e.token for e in ours.top_logits] == top_ids
        assert [e.token for e in ours.bottom_logits] == bottom_ids
        values = [e.value for e in ours.top_logits + ours.bottom_logits]
        assert max(abs(a - b) for a, b in zip(values, top_values + bottom_values)) < 1e-5
        if not r["count"]:
            assert ours.dead and not ours.top and not ours.quantiles and f in dash.dead
            continue
        active += 1
        assert ours.histogram.counts == r["hist"]
        assert ours.histogram.edges == [j * r["hist_width"] for j in range(ARGS["bins"] + 1)]
        assert [(g.low, g.high, g.count) for g in ours.quantiles] == [(g["low"], g["high"], g["count"])
                                                                       for g in r["quantiles"]]
        for g, rg in zip(ours.quantiles, r["quantiles"]):
            assert_examples(g.examples, rg["examples"])
    # Effect size: a no-op cannot pass.
    assert active > len(features) // 2 and sum(len(ref[f]["quantiles"]) for f in features) > active


def assert_same(a, b):
    """Two runs of the same corpus: identical lists and counts, floats equal to float32 noise."""
    assert a.features == b.features and a.dead == b.dead
    for f in a.features:
        x, y = a[f], b[f]
        assert (x.tokens, x.count, x.histogram.counts, x.histogram.edges) == (y.tokens, y.count, y.histogram.counts,
                                                                              y.histogram.edges)
        assert math.isclose(x.mean, y.mean, rel_tol=1e-6) and abs(x.max - y.max) <= 1e-6
        for ex, ey in zip([x.top] + [g.examples for g in x.quantiles], [y.top] + [g.examples for g in y.quantiles]):
            assert [(e.corpus_index, e.position, e.tokens) for e in ex] == [(e.corpus_index, e.position, e.tokens)
                                                                           for e in ey]
            assert all(max(abs(p - q) for p, q in zip(e.activations, d.activations)) <= 1e-6 for e, d in zip(ex, ey))
        assert [(g.low, g.high, g.count) for g in x.quantiles] == [(g.low, g.high, g.count) for g in y.quantiles]


# ---------------------------------------------------------------- against the reference


def test_every_field_equals_the_reference(setup):
    llm, texts, _, ref, logits, _ = setup
    dash = feature_dashboards(llm, texts, sae="res1", **ARGS)
    assert_matches_reference(dash, ref, logits)
    assert dash.tokens == sum(len(llm.llm_engine.tokenize(t)) for t in texts)


def test_batching_chunking_pieces_and_shards_change_nothing(setup, monkeypatch):
    from steerable.sae.dashboards.accumulate import DeviceAccumulator

    llm, texts, sae, ref, logits, path = setup
    whole = feature_dashboards(llm, texts, sae="res1", **ARGS)
    # One text in the engine at a time; rows encoded 9 at a time, so most texts go in pieces with context.
    assert_same(whole, feature_dashboards(llm, texts, sae="res1", batch_size=1, chunk_rows=9, **ARGS))
    # Candidates merged after every chunk (by count), or only once the shard is done.
    for every, candidates in ((10**9, 1), (10**9, 10**9)):
        monkeypatch.setattr(DeviceAccumulator, "merge_every", every)
        monkeypatch.setattr(DeviceAccumulator, "merge_candidates", candidates)
        assert_same(whole, feature_dashboards(llm, texts, sae="res1", chunk_rows=9, **ARGS))
    monkeypatch.undo()
    # As many quantile bins as histogram bins: one grid, moved once for both counts as the maxima grow.
    alike = dict(ARGS, quantiles=ARGS["bins"])
    assert_same(feature_dashboards(llm, texts, sae="res1", **alike),
                feature_dashboards(llm, texts, sae="res1", chunk_rows=9, **alike))
    # Chunked prefill: a 16-token budget splits every prompt over several steps.
    chunked = LLM(path, device="cpu", kv_cache_tokens=2048, max_num_batched_tokens=16)
    chunked.register_sae("res1", sae)
    assert_same(whole, feature_dashboards(chunked, texts, sae="res1", batch_size=5, chunk_rows=40, **ARGS))
    # Shards computed apart (as replicas would) and merged, in either order.
    run = plan(llm, texts, "res1", shard_size=5, batch_size=4, chunk_rows=64, **ARGS)
    states = [run_shards(llm, texts, run, empty_state(run), shards) for shards in ([0, 2], [1], [3, 4])]
    merged = states[2]
    merged.merge(states[0])
    merged.merge(states[1])
    whole.state = merged
    assert_matches_reference(whole, ref, logits)


def test_excluded_positions_and_tokens_count_as_zero(setup, capture_dirs):
    llm, texts, sae, *_ = setup
    hf = hf_model(capture_dirs["qwen3"])
    ids = [llm.llm_engine.tokenize(t) for t in texts]
    common = max(set(sum(ids, [])), key=sum(ids, []).count)
    acts = []
    for p, text_ids in zip(hf_points(hf, ids, sae.layer, sae.hook), ids):
        a = sae.encode(p)
        a[0] = 0.0
        a[torch.tensor(text_ids) == common] = 0.0
        acts.append(a)
    ref = reference(acts, ids, list(range(D_SAE)), ARGS["n_top"], *ARGS["context"], ARGS["quantiles"],
                    ARGS["n_quantile"], ARGS["bins"], ARGS["seed"])
    dash = feature_dashboards(llm, texts, sae="res1", exclude_positions=[0], exclude_tokens=[common], chunk_rows=20,
                              **ARGS)
    assert_matches_reference(dash, ref, reference_logits(hf, sae, list(range(D_SAE)), ARGS["n_logits"], False))
    assert all(e.position != 0 and e.tokens[e.offset] != common for f in dash.features for e in dash[f].top)


def test_feature_subset_and_topk_sae(setup, capture_dirs):
    llm, texts, _, ref, logits, _ = setup
    subset = [3, 17, 5, 29]
    dash = feature_dashboards(llm, texts, sae="res1", features=subset, **ARGS)
    assert_matches_reference(dash, ref, logits, sorted(subset))
    with pytest.raises(ValueError, match="feature: 4 is not a feature"):
        dash[4]
    # A top-k SAE at pre_attn of a Gemma 3 model (final norm (1 + w): the logits' scale).
    path = capture_dirs["gemma3"]
    gemma, hf = LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)
    sae = random_sae(gemma.llm_engine.model_config.hidden_size, "topk", 2, "pre_attn", seed=5)
    gemma.register_sae("pre2", sae)
    ids = [gemma.llm_engine.tokenize(t) for t in texts[:12]]
    points = hf_points(hf, ids, 2, "pre_attn")
    pre = torch.cat([sae.pre_activations(p) for p in points]).relu().sort(dim=1, descending=True).values
    assert ((pre[:, 5] - pre[:, 6]) > MARGIN).all()  # no row's k-th feature is a near tie
    gref = reference([sae.encode(p) for p in points], ids, list(range(D_SAE)), ARGS["n_top"], *ARGS["context"],
                     ARGS["quantiles"], ARGS["n_quantile"], ARGS["bins"], ARGS["seed"])
    gdash = feature_dashboards(gemma, texts[:12], sae="pre2", **ARGS)
    glogits = reference_logits(hf, sae, list(range(D_SAE)), ARGS["n_logits"], unit_offset=True)
    for f in range(D_SAE):
        assert_examples(gdash[f].top, gref[f]["top"])
        assert gdash[f].count == gref[f]["count"]
        assert [e.token for e in gdash[f].top_logits] == glogits[f][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda(setup, monkeypatch):
    """float32 on CUDA equals the reference (several chunks on the accumulator's own stream, each
    step's rows uploaded in one copy, graphs on; the pools' windows on the device, and on the host
    as when they do not fit there); bfloat16 agrees with the engine's own feature capture of every feature."""
    import steerable
    from steerable.sae.dashboards import accumulate

    llm, texts, sae, ref, logits, path = setup
    gpu = LLM(path, device="cuda", dtype="float32", kv_cache_tokens=4096)
    gpu.register_sae("res1", sae)
    assert accumulate.window_device(empty_state(plan(gpu, texts, "res1", **ARGS)), torch.device("cuda")).type == "cuda"
    interval = sys.getswitchinterval()
    assert_matches_reference(feature_dashboards(gpu, texts, sae="res1", chunk_rows=64, **ARGS), ref, logits)
    assert sys.getswitchinterval() == interval  # the pass's shorter GIL interval is restored
    monkeypatch.setattr(accumulate, "window_device", lambda state, device: torch.device("cpu"))
    assert_matches_reference(feature_dashboards(gpu, texts, sae="res1", chunk_rows=64, **ARGS), ref, logits)
    gpu.shutdown()
    bf16 = LLM(path, device="cuda", dtype="bfloat16", kv_cache_tokens=4096)
    bf16.register_sae("res1", sae)
    dash = feature_dashboards(bf16, texts, sae="res1", chunk_rows=64, **ARGS)
    rows = steerable.capture(bf16, texts, stream="sae_features", saes=["res1"], top_k=D_SAE,
                             select="all_prompt").rows("res1").dense(D_SAE)
    assert dash.tokens == len(rows)
    for f in range(D_SAE):
        count = int((rows[:, f] > 0).sum())
        assert abs(dash[f].count - count) <= max(2, count // 100), f
        if count:
            assert abs(dash[f].max - float(rows[:, f].max())) <= 2e-2 * float(rows[:, f].max()), f
    bf16.shutdown()


# ---------------------------------------------------------------- the pieces, exactly


def test_grid_is_exact_and_order_free():
    g = torch.Generator().manual_seed(0)
    values = torch.rand(5000, generator=g) ** 3 * 40
    for n in (1, 3, 10, 40):
        e = grid_exponent(values.max().unsqueeze(0), n)
        w = 2.0 ** int(e)
        assert n * w > values.max() >= n * w / 2
        whole = torch.bincount(bin_index(values, e.expand_as(values)), minlength=n)
        # Folded a batch at a time on the running grid, as the device does.
        counts, peak = torch.zeros(1, n, dtype=torch.long), torch.zeros(1)
        for part in values[torch.randperm(len(values), generator=g)].split(333):
            new_peak = torch.maximum(peak, part.max().unsqueeze(0))
            counts = regrid(counts, peak, new_peak, n)
            counts[0] += torch.bincount(bin_index(part, grid_exponent(new_peak, n).expand_as(part)), minlength=n)
            peak = new_peak
        assert torch.equal(counts[0], whole)
    assert int(grid_exponent(torch.zeros(1), 4)) < -1000  # no activation: no grid
    keys = sample_keys(0, torch.arange(1000), torch.zeros(1000), torch.zeros(1000))
    assert keys.min() >= 0 and keys.max() < 2**32 and len(set(keys.tolist())) == 1000
    assert not torch.equal(keys, sample_keys(1, torch.arange(1000), torch.zeros(1000), torch.zeros(1000)))


@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available() and not grid.fused.enabled(torch.zeros(1)),
                    reason="needs a GPU or TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1")
def test_sample_keys_kernel_equals_the_torch_ops():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    n = 3000  # not a multiple of the kernel's block
    feature = torch.randint(2**17, (n,), generator=g)
    example = torch.randint(2**40, (n,), generator=g)  # above 2**32: the high word is hashed too
    position = torch.randint(2**24, (n,), generator=g)
    for seed in (0, 11, 2**31 + 5, -7, 2**45 + 3):
        want = grid.sample_keys_torch(seed, feature, example, position)
        got = grid.sample_keys(seed, feature.to(device), example.to(device), position.to(device).int())
        assert torch.equal(got.cpu(), want), seed
    assert len(set(want.tolist())) > n - 5  # distinct keys: a constant cannot pass


def test_merges_keep_the_same_examples_whatever_the_split():
    """Pools filled from the same examples in any order and split keep the same examples, placed
    without moving those that stay; ties (values are rounded) go by corpus order."""
    g = torch.Generator().manual_seed(1)
    n, features, n_top, quantiles, n_q = 400, 5, 4, 4, 3
    feature = torch.randint(features, (n,), generator=g)
    value = torch.rand(n, generator=g).round(decimals=2) + 0.01
    example, position = torch.randint(50, (n,), generator=g), torch.randperm(n, generator=g)
    key = sample_keys(7, feature, example, position)

    def run(order, split):
        top, res = Places.empty(features, n_top), Places.empty(features, quantiles * n_q)
        peak = torch.zeros(features)
        for part in order.split(split):
            f = feature[part]
            peak = peak.scatter_reduce(0, f, value[part], "amax")
            exponent = grid_exponent(peak, quantiles)
            columns = (value[part], example[part], position[part], key[part], part)
            for pool, group, primary, cap, groups, order_ in (
                    (top, torch.zeros_like(f), descending(value[part]), n_top, 1, top_order),
                    (res, bin_index(value[part], exponent[f]), key[part], n_q, quantiles, reservoir_order(exponent))):
                rows, arriving = pack(f, group, primary, cap, groups, columns)
                before = pool.rows(rows)
                new, row, place, source = merge_rows(pool, arriving, rows, order_, cap)
                stayed = new.held() & (new.source == before.source) & before.held()
                assert torch.equal(new.example[stayed], before.example[stayed])  # kept examples do not move
                assert torch.equal(new.source[row, place], source)
                pool.set_rows(rows, new)
        return top, res, peak

    def kept(places, f):
        return sorted(places.source[f][places.held()[f]].tolist())

    expected = run(torch.arange(n), n)
    for split in (1, 7, 50, 399):
        got = run(torch.randperm(n, generator=g), split)
        for f in range(features):
            assert kept(got[0], f) == kept(expected[0], f) and kept(got[1], f) == kept(expected[1], f)
    top, res, peak = expected
    exponent = grid_exponent(peak, quantiles)
    for f in range(features):  # brute force: the definitions
        mine = (feature == f).nonzero().squeeze(1).tolist()
        best = sorted(mine, key=lambda i: (-float(value[i]), int(example[i]), int(position[i])))[:n_top]
        assert kept(top, f) == sorted(best)
        bins: dict[int, list[int]] = {}
        for i in mine:
            bins.setdefault(int(bin_index(value[i:i + 1], exponent[f:f + 1])), []).append(i)
        drawn = [i for members in bins.values()
                 for i in sorted(members, key=lambda i: (int(key[i]), int(example[i]), int(position[i])))[:n_q]]
        assert kept(res, f) == sorted(drawn)


# ---------------------------------------------------------------- files, resume and bad input


def test_resume_equals_an_uninterrupted_run(setup, tmp_path, monkeypatch):
    llm, texts, _, ref, logits, _ = setup
    import steerable.sae.dashboards.files as files

    real = files.checkpoint
    calls = []

    def dies_after_two(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
    monkeypatch.setattr(files, "checkpoint", dies_after_two)
    with pytest.raises(Exception, match="killed"):
        feature_dashboards(llm, texts, sae="res1", out=tmp_path / "d", shard_size=5, **ARGS)
    monkeypatch.setattr(files, "checkpoint", real)
    assert llm.capture_status("hidden_states")["enabled"] is False  # the stream was stopped
    index = json.loads((tmp_path / "d" / "dashboards.json").read_text())
    assert index["shards_done"] == [0, 1] and not index["complete"]  # resumed from the third shard
    dash = feature_dashboards(llm, texts, sae="res1", out=tmp_path / "d", shard_size=5, resume=True, **ARGS)
    assert_matches_reference(dash, ref, logits)
    again = feature_dashboards(llm, texts, sae="res1", out=tmp_path / "d", shard_size=5, resume=True, **ARGS)
    assert_same(dash, again)  # finished: loaded, nothing recomputed
    from steerable.sae.dashboards import FeatureDashboards
    loaded = FeatureDashboards.load(tmp_path / "d")
    assert_matches_reference(loaded, ref, logits)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["batch-0.json", "dashboards.json",
                                                                 "state.safetensors", "vocab.json"]


def test_bad_input_names_the_field(setup, tmp_path):
    llm, texts, sae, *_ = setup
    cases = [(dict(sae="nope"), "sae: unknown SAE 'nope'"), (dict(n_top=0), "n_top"),
             (dict(context=(4000, 200)), "context: a window of 4000"), (dict(context=(3,)), "context"),
             (dict(texts=[]), "texts"), (dict(features=[D_SAE]), "features"), (dict(quantiles=-1), "quantiles"),
             (dict(bins=0), "bins"), (dict(chunk_rows=4), "chunk_rows"), (dict(exclude_positions=[-1]),
                                                                               "exclude_positions")]
    for change, message in cases:
        kwargs = {**ARGS, "texts": texts[:3], "sae": "res1", **change}
        with pytest.raises(ValueError, match=message):
            feature_dashboards(llm, **kwargs)
    feature_dashboards(llm, texts[:3], sae="res1", out=tmp_path / "d", **ARGS)
    other = SAE(sae.W_enc * 2, sae.b_enc, sae.W_dec, sae.b_dec, "jumprelu", threshold=sae.threshold,
                apply_b_dec_to_input=True, layer=1)
    llm.register_sae("other", other)
    try:
        with pytest.raises(ValueError, match="resume: sae_sha256 differs"):
            feature_dashboards(llm, texts[:3], sae="other", out=tmp_path / "d", resume=True, **ARGS)
        with pytest.raises(ValueError, match="already holds dashboards"):
            feature_dashboards(llm, texts[:3], sae="res1", out=tmp_path / "d", **ARGS)
    finally:
        llm.unregister_sae("other")
    from transcoder_helpers import random_transcoder

    llm.register_sae("tc", random_transcoder(d=llm.llm_engine.model_config.hidden_size))
    try:
        with pytest.raises(ValueError, match="sae: 'tc' is a Transcoder"):
            feature_dashboards(llm, texts[:3], sae="tc", **ARGS)
    finally:
        llm.unregister_sae("tc")
    llm.start_capture("hidden_states", layers=[0])
    try:
        with pytest.raises(ValueError, match="hidden_states capture stream is running"):
            feature_dashboards(llm, texts[:3], sae="res1", **ARGS)
    finally:
        llm.stop_capture("hidden_states")
    assert llm.generate("Hello", use_tqdm=False)[0].outputs[0].text is not None  # the engine serves on


# ---------------------------------------------------------------- the Neuronpedia export


def _sae_dashboard_feature(d, vocab_size: int, num_texts: int) -> dict:
    """What sae-dashboard's own converter writes for this feature's data (its data classes filled
    from our dashboard, then ``NeuronpediaConverter`` as its runner calls it)."""
    from types import SimpleNamespace

    from sae_dashboard.components import (
        ActsHistogramData,
        LogitsHistogramData,
        LogitsTableData,
        SequenceData,
        SequenceGroupData,
        SequenceMultiGroupData,
    )
    from sae_dashboard.feature_data import FeatureData
    from sae_dashboard.neuronpedia.neuronpedia_converter import NeuronpediaConverter

    def sequences(examples):
        return [SequenceData(token_ids=e.tokens, feat_acts=e.activations, qualifying_token_index=e.offset + 1)
                for e in examples]
    groups = [SequenceGroupData(f"TOP ACTIVATIONS<br>MAX = {d.max:.3f}", sequences(d.top))]
    groups += [SequenceGroupData(f"INTERVAL {g.low:.3f} - {g.high:.3f}<br>CONTAINS {g.count / d.tokens:.3%}",
                                 sequences(g.examples)) for g in reversed(d.quantiles)]
    used = max(j + 1 for j, c in enumerate(d.histogram.counts) if c)
    centres = [(a + b) / 2 for a, b in zip(d.histogram.edges, d.histogram.edges[1:])][:used]
    logit_centres = [(a + b) / 2 for a, b in zip(d.logits_histogram.edges, d.logits_histogram.edges[1:])]
    data = FeatureData(
        acts_histogram_data=ActsHistogramData(bar_heights=d.histogram.counts[:used], bar_values=centres,
                                              title=f"ACTIVATIONS<br>DENSITY = {d.density:.3%}"),
        logits_table_data=LogitsTableData([e.token for e in d.bottom_logits], [e.value for e in d.bottom_logits],
                                          [e.token for e in d.top_logits], [e.value for e in d.top_logits]),
        logits_histogram_data=LogitsHistogramData(bar_heights=d.logits_histogram.counts, bar_values=logit_centres),
        sequence_data=SequenceMultiGroupData(groups))
    model = SimpleNamespace(cfg=SimpleNamespace(d_vocab=vocab_size))
    cfg = SimpleNamespace(n_prompts_total=num_texts, n_tokens_in_prompt=0, huggingface_dataset_path="")
    vocab = {t: s for t, s in enumerate(d._vocab)}
    feature, = NeuronpediaConverter._process_features(model, {d.index: data}, cfg, vocab)
    return feature.to_dict()


def _same_shape(ours, theirs, where: str) -> None:
    """Same keys, same JSON types all the way down (an int where sae-dashboard writes an int...)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), (where, set(ours) ^ set(theirs))
        for key in theirs:
            _same_shape(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same_shape(a, b, f"{where}[{i}]")
    else:
        theirs = theirs.item() if hasattr(theirs, "item") else theirs
        assert type(ours) is type(theirs) or {type(ours), type(theirs)} <= {int, float}, (where, ours, theirs)
        if isinstance(theirs, float) and where.split(".")[-1] not in ("frac_nonzero", "bin_contains"):
            assert abs(ours - theirs) <= 1e-9, (where, ours, theirs)  # both rounded to 3 decimals
        elif isinstance(theirs, (int, str)) and not isinstance(theirs, bool):
            assert ours == theirs, (where, ours, theirs)


def test_export_matches_what_sae_dashboard_writes(setup, tmp_path):
    from sae_dashboard.neuronpedia.neuronpedia_dashboard import (
        NeuronpediaDashboardBatch,
    )

    llm, texts, *_ = setup
    dash = feature_dashboards(llm, texts, sae="res1", features=list(range(8)), **ARGS)
    assert dash.save(tmp_path, batch_features=3) == ["batch-0.json", "batch-1.json", "batch-2.json"]
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab) == dash.vocab_size and vocab[5] == dash.token_str(5)
    seen = []
    for name in ("batch-0.json", "batch-1.json", "batch-2.json"):
        batch = json.loads((tmp_path / name).read_text())
        assert (batch["model_id"], batch["layer"], batch["sae_set"]) == (dash.settings.model, 1, "res1")
        features = batch["features"]
        for feature in features:
            i = feature["feature_index"]
            seen.append(i)
            d = dash[i]
            assert feature.pop("maxActApprox") == round(d.max, 3)  # what Neuronpedia's import reads besides
            d._vocab = vocab
            _same_shape(feature, _sae_dashboard_feature(d, len(vocab), len(texts)), f"feature {i}")
            assert abs(feature["frac_nonzero"] - d.density) < 1e-12 and len(feature["activations"]) == len(d.top) + sum(
                len(g.examples) for g in d.quantiles)
        # The batch loads into sae-dashboard's own classes and writes back unchanged.
        assert NeuronpediaDashboardBatch(**batch).to_dict() == batch
    assert seen == list(range(8))
