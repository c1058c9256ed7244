"""What a vLLM user types first (issue 9 §6): prompt dicts, ``n``, ``cumulative_logprob``, the
engine alias, the version, and a CLI that checks its arguments before loading anything."""

import math
import subprocess
import sys
import time

import pytest
import torch

import steerable
from steerable import LLM, SamplingParams
from steerable.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_prompt_dicts_equal_plain_prompts(llm):
    ids = llm.get_tokenizer()("Hello world").input_ids
    plain = llm.generate(["Hello world", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    single = llm.generate({"prompt": "Hello world"}, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert dicts[1].prompt_token_ids == ids


@pytest.mark.parametrize("bad", [None, {"text": "hi"}, {"prompt": 5}, {"prompt": "a", "extra": 1},
                                 [5, 6.5, 7], [[5, 6.5]], 3.5, {"prompt_token_ids": "abc"}])
def test_bad_prompt_forms_name_prompt(llm, bad):
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_n_completions(llm):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, logprobs=1, ignore_eos=True)
    out = llm.generate("Hello world", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    # Completion i is the same as a single request seeded seed + i (vLLM's rule for siblings).
    for i, completion in enumerate(out.outputs):
        alone = llm.generate("Hello world", SamplingParams(max_tokens=5, temperature=1.0, seed=7 + i, logprobs=1,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate("Hello world", SamplingParams(n=2, max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert llm.llm_engine.stats()["num_free_blocks"] == llm.llm_engine.stats()["num_blocks"]


def test_cumulative_logprob(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, logprobs=0), use_tqdm=False)[0].outputs[0]
    expected = sum(entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs))
    assert math.isclose(out.cumulative_logprob, expected, rel_tol=1e-6)
    plain = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None


def test_non_finite_module_scale(llm):
    hidden = llm.llm_engine.model_config.hidden_size
    llm.register_steering_modules({"m": {0: torch.ones(hidden)}})
    try:
        for scale in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(InvalidRequestError, match="steering_module_ref"):
                llm.generate("Hello", SamplingParams(max_tokens=2, steering_module_ref=("m", scale)), use_tqdm=False)
    finally:
        llm.unregister_steering_modules("m")
    assert llm.get_steering_status()["rows_in_use"] == 0


class _CountingConsumer:
    def __init__(self):
        self.closed = 0

    def on_capture(self, request_id, stream, tensors, meta):
        pass

    def close(self):
        self.closed += 1


def test_model_config_is_public(llm, model_dirs):
    """``llm.model_config`` (and ``llm.llm_engine.model_config``, as vLLM users reach it): the
    model's shape as its HF config says, and what the engine chose."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dirs["qwen3"])
    config = llm.model_config
    assert config is llm.llm_engine.model_config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == \
        (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size)
    assert config.dtype == torch.float32 and config.max_model_len == llm.llm_engine.max_model_len
    assert (config.get_hidden_size(), config.get_vocab_size(), config.get_head_size()) == \
        (hf.hidden_size, hf.vocab_size, config.head_dim)
    vector = torch.ones(config.hidden_size)  # what the docs size their vectors with
    out = llm.generate("Hello", SamplingParams(max_tokens=2, steering_vectors={config.num_layers - 1: vector}),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_version_alias_and_shutdown(model_dirs):
    assert isinstance(steerable.__version__, str) and steerable.__version__[0].isdigit()
    consumer = _CountingConsumer()
    with LLM(model_dirs["qwen2"], device="cpu", kv_cache_tokens=1024) as llm:
        assert llm.llm_engine is llm.engine
        llm.add_capture_consumer(consumer)
        llm.generate("Hello", GREEDY, use_tqdm=False)
        assert consumer.closed == 0
    assert consumer.closed == 1 and llm.llm_engine.stats()["kv_cache_bytes"] == 0
    llm.shutdown()  # idempotent
    assert consumer.closed == 1
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hello", GREEDY, use_tqdm=False)


def _cli(*args, timeout=60):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "steerable.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("args, field", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "-2"], "top_k"),
    (["--n", "0"], "n"),
    (["--dtype", "int3"], "dtype"),
    (["--block-size", "12"], "block_size"),
])
def test_cli_rejects_bad_arguments_before_loading(args, field):
    proc, elapsed = _cli("generate", "--model", "/nonexistent/model/dir", *args)
    assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr
    assert elapsed < 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_cuda_without_cuda_says_so():
    proc, _ = _cli("generate", "--model", "/nonexistent/model/dir", "--device", "cuda")
    assert proc.returncode == 2 and "CUDA" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_help_has_no_markup():
    for args in (["--help"], ["generate", "--help"]):
        proc, _ = _cli(*args)
        assert proc.returncode == 0 and "``" not in proc.stdout
    proc, _ = _cli("generate", "--help")
    for flag in ("--top-k", "--stop", "--n", "--logprobs", "--enforce-eager", "--kv-cache-tokens"):
        assert flag in proc.stdout
