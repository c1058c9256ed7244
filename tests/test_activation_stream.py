"""``ActivationStream``: over one epoch its rows are exactly HF's hidden states of SAELens' windows
of the texts (as a multiset; in order without a shuffle), one seed gives the same batches and
another seed different ones, a SAELens SAE trains from it, and stopping early frees the engine."""

import itertools

import pytest
import torch
from conftest import CORPUS, hf_model
from transformers import AutoTokenizer

import steerable
from steerable import LLM, ActivationStream
from steerable.capture.windows import token_windows
from steerable.errors import InvalidRequestError

TEXTS = [f"{i}: {CORPUS[i % 7]} {CORPUS[(3 * i) % 7]}" for i in range(24)]
CONTEXT = 16


@pytest.fixture(scope="module")
def path(capture_dirs):
    return capture_dirs["llama"]


@pytest.fixture(scope="module")
def llm(path):
    # A small token budget: several chunks per epoch, so the mixing buffer serves many rounds.
    return LLM(path, device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def reference(path, llm):
    """SAELens' own windows of the texts and HF's hidden states on them: {hidden_states index: [rows, d]}."""
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences

    tok = llm.get_tokenizer()
    docs = (torch.tensor(tok(t, add_special_tokens=False).input_ids) for t in TEXTS)
    windows = torch.stack(list(concat_and_batch_sequences(docs, CONTEXT, begin_batch_token_id=tok.bos_token_id,
                                                          sequence_separator_token_id=tok.bos_token_id)))
    assert (windows[:, 0] == tok.bos_token_id).all() and len(windows) > 10
    return windows, hf_hidden(path, windows)


def own_windows(path):
    """The texts' windows cut by ``token_windows``, without SAELens."""
    tok = AutoTokenizer.from_pretrained(path)
    docs = (tok(t, add_special_tokens=False).input_ids for t in TEXTS)
    return torch.tensor(list(token_windows(docs, CONTEXT, tok.bos_token_id)))


def hf_hidden(path, windows):
    with torch.no_grad():
        hidden = hf_model(path)(windows, output_hidden_states=True).hidden_states
    return {i: h.reshape(-1, h.shape[-1]) for i, h in enumerate(hidden)}


def stream(llm, **kwargs):
    args = dict(layers=[0, 1], context_size=CONTEXT, batch_size=24, shuffle_buffer=96, device="cpu")
    return ActivationStream(llm, TEXTS, **{**args, **kwargs})


def rows_of(batches, names):
    """Yielded batches as one [rows, layers * d] tensor (the layers of a token side by side)."""
    return torch.cat([torch.cat([b[n] for n in names], 1) if isinstance(b, dict) else b for b in batches])


def assert_same_multiset(got, want, atol=1e-5):
    """Every row of ``got`` matches a distinct row of ``want`` within ``atol`` (rows repeat: the BOS
    opening every window has the same activations in each)."""
    assert got.shape == want.shape
    close = torch.cdist(got.double(), want.double(), p=float("inf")) <= atol
    free = torch.ones(len(want), dtype=torch.bool)
    for i in range(len(got)):
        match = (close[i] & free).nonzero()
        assert len(match), f"row {i} matches no row left"
        free[match[0]] = False


def test_epoch_is_the_windows_hidden_states(llm, reference):
    windows, hidden = reference
    s = stream(llm)
    assert s.hook_names == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"] and s.d_in == 64
    batches = list(s)
    assert all(set(b) == set(s.hook_names) for b in batches)
    sizes = [len(b[s.hook_names[0]]) for b in batches]
    assert sizes[:-1] == [24] * (len(sizes) - 1) and 0 < sizes[-1] <= 24
    assert sum(sizes) == windows.numel()  # every window, every position, once; the partial tail dropped
    got = rows_of(batches, s.hook_names)
    want = torch.cat([hidden[1], hidden[2]], 1)  # post_mlp of layer L is HF hidden_states[L + 1]
    assert_same_multiset(got, want)
    assert not torch.allclose(got[:24], want[:24])  # shuffled, not in window order


def test_own_windows_are_saelens(path, reference):
    assert torch.equal(own_windows(path), reference[0])


def test_no_shuffle_keeps_window_order_and_builds_its_own_engine(path, reference):
    _, hidden = reference
    with ActivationStream(path, TEXTS, layers=[2], hook="pre_attn", context_size=CONTEXT, batch_size=40,
                          shuffle_buffer=0, device="cpu", engine_kwargs={"kv_cache_tokens": 4096}) as s:
        batches = list(s)
    assert all(isinstance(b, torch.Tensor) for b in batches)  # one layer: plain tensors
    assert [len(b) for b in batches[:-1]] == [40] * (len(batches) - 1)
    assert torch.allclose(torch.cat(batches), hidden[2], atol=1e-5, rtol=0)  # pre_attn L = hidden_states[L]


def test_mlp_points_for_transcoders(llm, path, reference):
    """A transcoder's training pair, the MLP's input and its output, from two streams of one seed:
    row i of each is the same token; both equal HF hooks on the MLP."""
    windows, _ = reference
    model, seen = hf_model(path), {}
    mlp = model.model.layers[1].mlp
    mlp.register_forward_pre_hook(lambda mod, args: seen.__setitem__("in", args[0].detach().clone()))
    mlp.register_forward_hook(lambda mod, args, out: seen.__setitem__("out", out.detach().clone()))
    with torch.no_grad():
        model(windows)
    streams = {point: stream(llm, layers=[1], hook=point, seed=5) for point in ("mlp_in", "mlp_out")}
    assert streams["mlp_in"].hook_names == ["blocks.1.ln2.hook_normalized"]
    assert streams["mlp_out"].hook_names == ["blocks.1.hook_mlp_out"]
    got = {point: torch.cat(list(s)) for point, s in streams.items()}
    want = {point: seen[key].reshape(-1, 64) for point, key in (("mlp_in", "in"), ("mlp_out", "out"))}
    order = torch.cdist(got["mlp_in"].double(), want["mlp_in"].double(), p=float("inf")).argmin(1)
    for point in got:  # one shuffle for both: the same token at the same row
        assert torch.allclose(got[point], want[point][order], atol=1e-5, rtol=0)
    assert_same_multiset(got["mlp_out"], want["mlp_out"])


def test_seed_decides_the_batches(llm, reference):
    first, again = list(stream(llm, seed=3)), list(stream(llm, seed=3))
    other = list(stream(llm, seed=4))
    names = stream(llm).hook_names
    assert len(first) == len(again) and all(torch.equal(a[n], b[n]) for a, b in zip(first, again) for n in names)
    assert not torch.equal(rows_of(first, names), rows_of(other, names))
    assert_same_multiset(rows_of(other, names), rows_of(first, names), atol=0)
    s = stream(llm, seed=3)
    list(s)
    second_epoch = list(s)  # a new epoch of one stream is shuffled anew
    assert not torch.equal(rows_of(second_epoch, names), rows_of(first, names))


def test_drop_last(llm, reference):
    windows, _ = reference
    batches = list(stream(llm, drop_last=True))
    assert {len(b["blocks.0.hook_resid_post"]) for b in batches} == {24}
    assert len(batches) == windows.numel() // 24


def test_stopping_early_frees_the_engine(llm):
    s = stream(llm)
    taken = list(itertools.islice(s, 2))  # the generator is closed here: the producer stops
    assert len(taken) == 2
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.capture_status("hidden_states")["enabled"]
    assert sum(len(b["blocks.0.hook_resid_post"]) for b in s) > 48  # the engine serves a new pass
    open_pass = iter(s)
    next(open_pass)
    with pytest.raises(RuntimeError, match="a pass is open"):
        iter(s)
    open_pass.close()
    assert not engine.has_unfinished_requests() and next(iter(s)) is not None


def test_sae_lens_trains_from_the_stream(llm):
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    s = stream(llm, layers=[1])
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=s.d_in, d_sae=128, k=8, dtype="float32", device="cpu"))
    before = sae.W_enc.detach().clone()
    cfg = SAETrainerConfig(total_training_samples=5 * 24, train_batch_size_samples=24, device="cpu", lr=1e-3,
                           lr_end=1e-3, n_batches_for_norm_estimate=2)
    trainer = SAETrainer(cfg, sae, iter(s))
    trained = trainer.fit()
    assert trainer.n_training_steps == 5
    assert torch.isfinite(trained.W_enc).all() and (trained.W_enc - before).abs().max() > 1e-5
    with pytest.raises(InvalidRequestError, match="end the pass of another ActivationStream"):
        next(iter(stream(llm)))  # the trainer still holds its pass, paused in mid-epoch
    s.close()  # ends it: the engine is free for the next
    assert not llm.llm_engine.has_unfinished_requests()
    # Several layers: the dict of hook names MultiSAETrainer routes to one SAE per hook.
    from sae_lens.training.multi_sae_trainer import MultiSAETrainer

    two = stream(llm)
    saes = {f"l{i}": TopKTrainingSAE(TopKTrainingSAEConfig(d_in=64, d_sae=96, k=4, dtype="float32", device="cpu"))
            for i in (0, 1)}
    before = {name: sae.W_enc.detach().clone() for name, sae in saes.items()}
    multi = MultiSAETrainer(cfg, saes, dict(zip(saes, two.hook_names)), iter(two))
    for name, sae in multi.fit().items():
        assert (sae.W_enc - before[name]).abs().max() > 1e-5
    assert multi.n_training_steps == 5


def test_bad_arguments(llm, path):
    for kwargs, field in [(dict(layers=[3]), "layers"), (dict(layers=[]), "layers"), (dict(layers=[0, 0]), "layers"),
                          (dict(hook="post_norm"), "hook"), (dict(context_size=1), "context_size"),
                          (dict(context_size=10**6), "context_size"), (dict(shuffle_buffer=5), "shuffle_buffer"),
                          (dict(batch_size=0), "batch_size"), (dict(dtype="int8"), "dtype"),
                          (dict(bos_token_id="bos"), "bos_token_id"), (dict(seed=-1), "seed")]:
        with pytest.raises(InvalidRequestError, match=field):
            stream(llm, **kwargs)
    bad = ActivationStream(llm, ["fine", 3.5], layers=[0], context_size=4, batch_size=2, shuffle_buffer=0, device="cpu")
    with pytest.raises(InvalidRequestError, match=r"texts\[1\]"):  # raised on the producer thread, seen here
        list(bad)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.start_capture("hidden_states", layers=[0], select="last_prompt")
    try:
        with pytest.raises(InvalidRequestError, match="hidden_states capture stream is running"):
            list(stream(llm))
    finally:
        llm.stop_capture("hidden_states")


def test_exported_lazily():
    assert steerable.ActivationStream is ActivationStream and "ActivationStream" in steerable.__all__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stream_on_the_gpu_equals_hf(path):
    """The engine on the GPU (on its thread, pinned chunks, an asynchronous copy into the mixing
    buffer): float32 rows on the device equal HF's within GPU float32 noise, in both epochs. The
    windows are ``own_windows`` (SAELens' on the CPU), so this runs where sae_lens is not installed."""
    hidden = hf_hidden(path, own_windows(path))
    with ActivationStream(path, TEXTS, layers=[0, 1], context_size=CONTEXT, batch_size=24, shuffle_buffer=96,
                          device="cuda", dtype="float32",
                          engine_kwargs={"dtype": "float32", "kv_cache_tokens": 4096}) as s:
        batches = list(s)
        again = list(s)
    assert all(b[n].device.type == "cuda" for b in batches for n in s.hook_names)
    got = rows_of(batches, s.hook_names).cpu()
    assert_same_multiset(got, torch.cat([hidden[1], hidden[2]], 1), atol=1e-3)
    assert_same_multiset(rows_of(again, s.hook_names).cpu(), got, atol=1e-3)
