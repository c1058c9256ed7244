"""Corpus capture in the formats other tools read, judged by those tools: SAELens' activation cache
opens with ``datasets.load_from_disk``, its windows are SAELens' own ``concat_and_batch_sequences``,
its activations equal HF ``output_hidden_states`` and SAELens trains an SAE from it; delphi's
latent cache loads with delphi's ``LatentDataset`` and holds the SAE's latents of HF hidden states."""

import json
import os
import random
import subprocess
import sys
import time

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import CORPUS, hf_model
from corpus_harness import kill_after_first_shard
from sae_lens.tokenization_and_batching import concat_and_batch_sequences

import steerable
from steerable import LLM, SAE
from steerable.capture.windows import corpus_windows, token_windows
from steerable.entrypoints.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"{i}: {CORPUS[i % 7]}" * (1 + i % 3) for i in range(14)]
N = 16


@pytest.fixture(scope="module")
def engines(capture_dirs):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = LLM(capture_dirs[family], device="cpu", kv_cache_tokens=2048)
        return cache[family]
    return get


def saelens_windows(tokenizer, texts, context_size):
    """SAELens' own packing of the texts tokenized without special tokens (its defaults)."""
    docs = (torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=torch.long) for t in texts)
    bos = tokenizer.bos_token_id
    return torch.stack(list(concat_and_batch_sequences(docs, context_size=context_size, begin_batch_token_id=bos,
                                                       begin_sequence_token_id=None,
                                                       sequence_separator_token_id=bos)))


def hf_hidden(path, windows):
    with torch.no_grad():
        return hf_model(path)(windows, output_hidden_states=True).hidden_states


def files(out):
    return {name: (out / name).read_bytes() if (out / name).is_file() else None for name in sorted(os.listdir(out))}


def test_windows_are_saelens_windows():
    """Random documents (some starting with BOS, some empty, some longer than a window), with and
    without a BOS token: the same windows as SAELens' function."""
    rng = random.Random(0)
    for _ in range(200):
        bos = rng.choice([1, None])
        docs = [[rng.randint(0, 4) for _ in range(rng.choice([0, 1, 2, 3, 7, 20, 41]))] for _ in range(rng.randint(0, 9))]
        n = rng.choice([2, 3, 5, 16])
        ref = list(concat_and_batch_sequences(iter(torch.tensor(d, dtype=torch.long) for d in docs), context_size=n,
                                              begin_batch_token_id=bos, begin_sequence_token_id=None,
                                              sequence_separator_token_id=bos))
        ours = list(token_windows(docs, n, bos))
        assert len(ours) == len(ref) and all(torch.equal(torch.tensor(w), r) for w, r in zip(ours, ref))


def test_corpus_windows_of_texts_and_of_token_ids(engines, monkeypatch):
    """Texts packed a chunk of windows at a time (here two) into one int32 array; token-id windows
    taken as given; anything else refused naming ``texts``."""
    from steerable.capture import windows

    tok = engines("llama").get_tokenizer()
    monkeypatch.setattr(windows, "TOKENIZE_BATCH", 2)
    packed = corpus_windows(TEXTS, N, tok, 384)
    assert packed.dtype == np.int32 and torch.equal(torch.from_numpy(packed).long(), saelens_windows(tok, TEXTS, N))
    assert np.array_equal(corpus_windows(packed.tolist(), N, tok, 384), packed)
    for bad in ([[1, 2]], [packed[0].tolist(), "text"], [[999] * N]):
        with pytest.raises(ValueError, match="texts"):
            corpus_windows(bad, N, tok, 384)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_saelens_cache_is_hf_hidden_states_on_saelens_windows(engines, capture_dirs, tmp_path, family):
    llm = engines(family)
    index = steerable.capture_corpus(llm, TEXTS, tmp_path, format="saelens", context_size=N, layers=[0, 1],
                                     hook="post_mlp", shard_size=3, dtype="float32")
    windows = saelens_windows(llm.get_tokenizer(), TEXTS, N)
    shards = -(-len(windows) // 3)
    assert index["complete"] and index["num_examples"] == len(windows) > 6 and len(index["shards"]) == shards
    assert set(os.listdir(tmp_path)) == {f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)} | {
        "dataset_info.json", "state.json", "index.json"}
    ds = datasets.load_from_disk(str(tmp_path))
    assert ds.features == datasets.Features({
        "blocks.0.hook_resid_post": datasets.Array2D(shape=(N, 64), dtype="float32"),
        "blocks.1.hook_resid_post": datasets.Array2D(shape=(N, 64), dtype="float32"),
        "token_ids": datasets.Sequence(datasets.Value("int32"), length=N)})
    rows = ds.with_format("torch")[:]
    assert torch.equal(rows["token_ids"].long(), windows)
    hidden = hf_hidden(capture_dirs[family], windows)
    for layer in (0, 1):
        ours = rows[f"blocks.{layer}.hook_resid_post"]
        assert ours.shape == (len(windows), N, 64)
        assert (ours - hidden[layer + 1]).abs().max() <= 1e-5
    assert (hidden[2] - hidden[1]).abs().max() > 1e-2 and (hidden[1][0] - hidden[1][1]).abs().max() > 1e-2


def test_pre_attn_float16_and_what_saelens_reads(engines, capture_dirs, tmp_path):
    llm = engines("llama")
    steerable.capture_corpus(llm, TEXTS, tmp_path, format="saelens", context_size=N, layers=[2], hook="pre_attn",
                             dtype="float16")
    ds = datasets.load_from_disk(str(tmp_path)).with_format("numpy")
    assert ds.features["blocks.2.hook_resid_pre"] == datasets.Array2D(shape=(N, 64), dtype="float16")
    windows = saelens_windows(llm.get_tokenizer(), TEXTS, N)
    assert str(ds.data.column("blocks.2.hook_resid_pre").type.storage_type) == "list<item: list<item: halffloat>>"
    ours = torch.from_numpy(ds[:]["blocks.2.hook_resid_pre"])  # datasets hands float16 out as float32
    reference = hf_hidden(capture_dirs["llama"], windows)[2]  # HF hidden_states[L] = pre_attn L
    assert (ours - reference).abs().max() <= 2**-11 * reference.abs().max()  # float16 rounding of equal values


def test_saelens_trains_an_sae_from_the_cache(engines, tmp_path):
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    steerable.capture_corpus(engines("llama"), TEXTS, tmp_path, format="saelens", context_size=N, layers=[1],
                             dtype="float32")
    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name="blocks.1.hook_resid_post",
                             hook_head_index=None, context_size=N, d_in=64, n_batches_in_buffer=4,
                             total_training_tokens=10**4, store_batch_size_prompts=2, train_batch_size_tokens=16,
                             prepend_bos=True, normalize_activations="none", device=torch.device("cpu"),
                             dtype="float32", cached_activations_path=str(tmp_path))
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=64, d_sae=96, dtype="float32", device="cpu"))
    before = sae.W_enc.detach().clone()
    trainer = SAETrainer(cfg=SAETrainerConfig(total_training_samples=16 * 6, train_batch_size_samples=16, lr_end=1e-5,
                                              device="cpu", n_batches_for_norm_estimate=2),
                         sae=sae, data_provider=store)
    trainer.fit()
    assert trainer.n_training_steps == 6 and (sae.W_enc - before).abs().max() > 0


def random_topk_sae(layer: int, k: int = 6) -> SAE:
    g = torch.Generator().manual_seed(3)
    return SAE(torch.randn(64, 96, generator=g) * 0.4, torch.randn(96, generator=g) * 0.1,
               torch.randn(96, 64, generator=g), torch.zeros(64), architecture="topk", k=k, layer=layer,
               hook="post_mlp")


def test_delphi_cache_loads_with_delphi_and_holds_the_sae_latents(engines, capture_dirs, tmp_path):
    from delphi.config import ConstructorConfig, SamplerConfig
    from delphi.latents import LatentDataset

    llm = engines("llama")
    sae = random_topk_sae(layer=1)
    llm.register_sae("res1", sae)
    index = steerable.capture_corpus(llm, TEXTS, tmp_path, format="delphi", context_size=N, sae="res1",
                                     shard_size=2, n_splits=3)
    assert index["complete"] and index["top_k"] == 6
    hookpoint = tmp_path / "blocks.1.hook_resid_post"
    assert os.listdir(tmp_path) == ["blocks.1.hook_resid_post"]
    assert sorted(os.listdir(hookpoint)) == [".steerable", "0_31.safetensors", "32_63.safetensors",
                                             "64_95.safetensors", "config.json"]
    cache = LatentDataset(str(tmp_path), SamplerConfig(), ConstructorConfig(), tokenizer=llm.get_tokenizer())
    windows = saelens_windows(llm.get_tokenizer(), TEXTS, N)
    assert torch.equal(cache.tokens, windows) and cache.cache_config["cache_ctx_len"] == N
    loaded = [buffer.load() for buffer in cache.buffers]
    locations = torch.cat([loc for loc, _, _ in loaded])
    activations = torch.cat([act for _, act, _ in loaded])
    # the reference: the SAE on HF's hidden states, every latent above delphi's threshold
    latents = sae.encode(hf_hidden(capture_dirs["llama"], windows)[2].reshape(-1, 64)).reshape(len(windows), N, 96)
    expected = torch.nonzero(latents.abs() > 1e-5)  # torch.nonzero's order, as delphi's own cache keeps it
    for (start, end), (loc, _, _) in zip([(0, 31), (32, 63), (64, 95)], loaded):
        assert torch.equal(loc, expected[(expected[:, 2] >= start) & (expected[:, 2] <= end)])
    assert len(locations) >= len(windows) * N  # most tokens fire all k latents
    mine = torch.zeros_like(latents)
    mine[locations[:, 0], locations[:, 1], locations[:, 2]] = activations.float()
    assert (mine - latents).abs().max() <= 2e-3 * latents.abs().max()  # stored as float16
    records = list(LatentDataset(str(tmp_path), SamplerConfig(n_examples_train=2, n_examples_test=2, n_quantiles=2),
                                 ConstructorConfig(min_examples=2, example_ctx_len=N, n_non_activating=1),
                                 tokenizer=llm.get_tokenizer()))
    assert records and all(r.examples for r in records)  # delphi builds its examples from our cache
    llm.unregister_sae("res1")


def test_cli_saelens_from_texts_token_windows_and_a_dataset_dir(engines, capture_dirs, tmp_path):
    model = capture_dirs["llama"]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = ["--format", "saelens", "--context-size", str(N), "--layers", "0,1", "--hook", "post_mlp",
              "--dtype", "float32", "--device", "cpu", "--kv-cache-tokens", "2048"]
    assert main(["capture", model, "--input", str(tmp_path / "corpus.jsonl"), *common, "--out",
                 str(tmp_path / "cli")]) == 0
    steerable.capture_corpus(engines("llama"), TEXTS, tmp_path / "api", format="saelens", context_size=N,
                             layers=[0, 1], dtype="float32")
    assert files(tmp_path / "cli") == files(tmp_path / "api")
    windows = saelens_windows(engines("llama").get_tokenizer(), TEXTS, N)
    (tmp_path / "windows.jsonl").write_text("".join(json.dumps({"token_ids": w}) + "\n" for w in windows.tolist()))
    assert main(["capture", model, "--input", str(tmp_path / "windows.jsonl"), *common, "--out",
                 str(tmp_path / "tokens")]) == 0
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "texts_ds"))
    assert main(["capture", "--model", model, "--input", str(tmp_path / "texts_ds"), *common, "--out",
                 str(tmp_path / "from_ds")]) == 0
    for other in ("tokens", "from_ds"):
        assert {k: v for k, v in files(tmp_path / other).items() if k.endswith(".arrow")} == {
            k: v for k, v in files(tmp_path / "api").items() if k.endswith(".arrow")}


def test_cli_delphi_from_an_saelens_sae_directory(engines, capture_dirs, tmp_path):
    """``--format delphi --sae DIR``: an SAE as SAELens saves it, the cache as the Python call writes it."""
    from sae_lens import TopKSAE, TopKSAEConfig

    cfg = TopKSAEConfig(d_in=64, d_sae=48, k=4)
    cfg.metadata.hook_name = "blocks.1.hook_resid_post"
    lens = TopKSAE(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for param in lens.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    lens.save_model(tmp_path / "sae")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert main(["capture", capture_dirs["llama"], "--input", str(tmp_path / "corpus.jsonl"), "--format", "delphi",
                 "--sae", str(tmp_path / "sae"), "--context-size", str(N), "--n-splits", "2", "--device", "cpu",
                 "--kv-cache-tokens", "2048", "--out", str(tmp_path / "cli")]) == 0
    llm = engines("llama")
    steerable.capture_corpus(llm, TEXTS, tmp_path / "api", format="delphi", sae=SAE.load(str(tmp_path / "sae")),
                             context_size=N, n_splits=2, source=str(tmp_path / "corpus.jsonl"))
    assert llm.list_saes() == {}  # an SAE object is registered for the run only
    hookpoint = "blocks.1.hook_resid_post"
    cli, api = files(tmp_path / "cli" / hookpoint), files(tmp_path / "api" / hookpoint)
    assert sorted(cli) == [".steerable", "0_23.safetensors", "24_47.safetensors", "config.json"]
    assert {k: v for k, v in cli.items() if k != ".steerable"} == {k: v for k, v in api.items() if k != ".steerable"}
    assert json.loads(cli["config.json"])["model_name"] == capture_dirs["llama"]


def test_saelens_run_killed_then_resumed_is_the_uninterrupted_dataset(engines, capture_dirs, tmp_path):
    """A process killed mid-run leaves only whole, listed shards and no dataset metadata (not a
    dataset yet); ``--resume`` completes it to the same bytes as a run never interrupted."""
    texts = [f"{i} {CORPUS[i % 7]}" for i in range(120)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = ["capture", capture_dirs["llama"], "--input", str(tmp_path / "corpus.jsonl"), "--format", "saelens",
            "--context-size", str(N), "--layers", "0-2", "--shard-size", "2", "--batch-size", "2", "--device", "cpu",
            "--kv-cache-tokens", "1024"]
    cut = kill_after_first_shard([*args, "--out", str(tmp_path / "cut")], tmp_path / "cut" / "index.json")
    assert 1 <= len(cut["shards"]) < -(-cut["num_examples"] // 2) and not cut["complete"]
    present = {n for n in os.listdir(tmp_path / "cut") if n.startswith("data-")}
    listed = {e["file"] for e in cut["shards"]}
    assert listed <= present
    for name in present - listed:  # renamed into place, killed before the index took it: whole, redone on resume
        with pa.OSFile(str(tmp_path / "cut" / name)) as f:
            assert pa.ipc.open_stream(f).read_all().num_rows > 0  # nothing half-written under a shard's name
    assert not (tmp_path / "cut" / "state.json").exists()
    with pytest.raises(FileNotFoundError):
        datasets.load_from_disk(str(tmp_path / "cut"))
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert files(tmp_path / "cut") == files(tmp_path / "whole")
    assert main([*args, "--out", str(tmp_path / "whole")]) == 2  # without --resume: refused
    other = ["capture", *args[1:3], str(tmp_path / "other.jsonl"), *args[4:]]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"text": t + "!"}) + "\n" for t in texts))
    assert main([*other, "--out", str(tmp_path / "whole"), "--resume"]) == 2  # another corpus


@pytest.mark.parametrize("kwargs, field", [
    (dict(select="last_prompt"), "select"), (dict(context_size=1), "context_size"),
    (dict(context_size=2048), "context_size"), (dict(context_size=None), "context_size"),
    (dict(dtype="bfloat16"), "dtype: the saelens format cannot store bfloat16"), (dict(dtype="int8"), "dtype"),
    (dict(format="parquet"), "format"), (dict(shard_size=10**9), "shard_size"), (dict(texts=[]), "texts"),
    (dict(texts=["a", [1, 2]]), "texts"), (dict(texts=[[1, 2, 3]]), "texts"), (dict(layers=[7]), "layers"),
    (dict(sae="res1"), "sae"), (dict(format="delphi"), "sae"), (dict(replicas=0), "replicas"),
])
def test_bad_arguments_write_nothing(engines, tmp_path, kwargs, field):
    llm = engines("llama")
    llm.register_sae("res1", random_topk_sae(layer=1))
    options = dict(format="saelens", context_size=N, layers=[1])
    options.update(kwargs)
    texts = options.pop("texts", TEXTS)
    with pytest.raises(ValueError, match=field):
        steerable.capture_corpus(llm, texts, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()
    llm.unregister_sae("res1")


def test_an_output_directory_with_other_files_is_refused(engines, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="out: .* is not empty"):
        steerable.capture_corpus(engines("llama"), TEXTS, tmp_path, format="saelens", context_size=N, layers=[1])
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_ray_missing_or_unreachable_is_answered_at_once(engines, tmp_path, monkeypatch):
    import socket

    pytest.importorskip("ray")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ValueError, match="ray: cannot reach a Ray cluster at '127.0.0.1"):
        steerable.capture_corpus(engines("llama"), TEXTS, tmp_path / "a", format="saelens", context_size=N,
                                 layers=[1], ray=f"127.0.0.1:{port}")
    assert time.monotonic() - started < 60 and not (tmp_path / "a").exists()
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'steerable\[ray\]'"):
        steerable.capture_corpus(engines("llama"), TEXTS, tmp_path / "b", format="saelens", context_size=N,
                                 layers=[1], ray="local")


def test_import_steerable_never_imports_ray():
    code = ("import sys, steerable, steerable.capture.corpus, steerable.entrypoints.cli.capture; "
            "steerable.capture_corpus; assert 'ray' not in sys.modules, 'ray imported'")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_a_cross_layer_transcoder_in_corpus_capture(engines, tmp_path):
    """A transcoder reading two layers: each row keeps its top features over both (flat indices),
    in steerable's shards as in the per-request capture, and delphi's cache holds them too."""
    from safetensors.torch import load_file
    from transcoder_helpers import random_transcoder

    llm = engines("llama")
    tc = random_transcoder(layers=2, layer=0, cross_layer=True, architecture="topk", k=5)
    llm.register_sae("clt", tc)
    index = steerable.capture_corpus(llm, TEXTS[:5], tmp_path / "shards", sae="clt", top_k=6, select="all_prompt",
                                     shard_size=2)
    assert index["layers"] == [0, 1] and index["hook"] == "mlp_in"
    shards = [load_file(tmp_path / "shards" / e["file"]) for e in index["shards"]]
    alone = steerable.capture(llm, TEXTS[:5], stream="sae_features", saes=["clt"], top_k=6,
                              select="all_prompt").rows("clt")
    assert torch.equal(torch.cat([s["indices"] for s in shards]), alone.indices)
    assert torch.equal(torch.cat([s["values"] for s in shards]), alone.values)
    assert int(alone.indices.max()) >= tc.d_sae // 2  # features of the second layer are among them
    steerable.capture_corpus(llm, TEXTS, tmp_path / "delphi", format="delphi", sae="clt", context_size=N, top_k=10)
    assert sorted(os.listdir(tmp_path / "delphi")) == ["blocks.0.ln2.hook_normalized"]
    llm.unregister_sae("clt")
