"""What the tensor/pipeline-parallel test modules share: the test models (the tiny families, a
Qwen3 with one KV head, a small Qwen3-MoE), one-rank reference engines, a deadline that turns a
hang into a failure, and ranks started from a fork server so engines start fast on two cores."""

from __future__ import annotations

import contextlib
import faulthandler
import os

import pytest
import torch
from conftest import build_tokenizer
from test_qwen3_moe import build_qwen3_moe

from steerable import LLM
from steerable.executor.launch import START_METHOD_ENV

# Families whose layers add nothing new to the layouts beyond TP=2 and PP=2 alone (their own parts:
# Gemma 2's softcapped attention, OLMo-2's all-reduced q/k norm, Phi-3's fused checkpoint tensors).
RMS_FAMILIES = ["gemma2", "olmo2", "phi3"]
HANG_S = 150  # one test (or one engine's start) past this is a hang: dump the stacks and fail


@contextlib.contextmanager
def deadline(seconds: float = HANG_S):
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _hang_guard():
    with deadline():
        yield


@pytest.fixture(scope="module", autouse=True)
def _fork_server():
    previous = os.environ.get(START_METHOD_ENV)
    os.environ[START_METHOD_ENV] = "forkserver"
    yield
    if previous is None:
        del os.environ[START_METHOD_ENV]
    else:
        os.environ[START_METHOD_ENV] = previous


def _build_qwen3_one_kv_head(path: str, seed: int) -> None:
    import transformers
    from transformers import AutoTokenizer

    build_tokenizer(path)
    config = transformers.Qwen3Config(
        vocab_size=len(AutoTokenizer.from_pretrained(path)), hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1,
        tie_word_embeddings=True)
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dirs, capture_dirs) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    dirs = {"llama": model_dirs["llama"], "qwen3": str(root / "qwen3"), "qwen3_moe": str(root / "qwen3_moe"),
            "gemma3": model_dirs["gemma3"], **{family: model_dirs[family] for family in RMS_FAMILIES},
            "gpt2": capture_dirs["gpt2"],  # activations of order one (the larger weights' reach 20)
            "gpt_neox": model_dirs["gpt_neox"], "gpt_neox_seq": model_dirs["gpt_neox_seq"]}
    _build_qwen3_one_kv_head(dirs["qwen3"], seed=7)
    build_qwen3_moe(dirs["qwen3_moe"], seed=8, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
                    norm_topk_prob=True)
    return dirs


def _engine(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096, **kw)


@pytest.fixture(scope="module")
def single(models) -> dict[str, LLM]:
    """The reference: each model on one rank."""
    return {family: _engine(path) for family, path in models.items()}


@contextlib.contextmanager
def _env(name: str, value: str | None):
    previous = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if previous is not None:
            os.environ[name] = previous
