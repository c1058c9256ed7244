"""SAELens' activation cache written on a GPU: the pinned copies, the capture sink's thread and CUDA
graphs feeding the writer. Read back with pyarrow (the device image has no ``datasets``); the
windows are ``token_windows``', which the CPU tests hold to SAELens' own function."""

import os

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import CORPUS, hf_model

import steerable
from steerable import LLM
from steerable.capture.windows import token_windows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N = 16
TEXTS = [f"{i}: {CORPUS[i % 7]}" * (1 + i % 3) for i in range(14)] * 8


def read_cache(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(``blocks.1.hook_resid_post`` as float32 ``[windows, N, 64]``, ``token_ids`` ``[windows, N]``)."""
    acts, tokens = [], []
    for name in sorted(n for n in os.listdir(out) if n.startswith("data-")):
        with pa.memory_map(os.path.join(out, name)) as source:
            table = pa.ipc.open_stream(source).read_all()
        column = table.column("blocks.1.hook_resid_post").combine_chunks()
        acts.append(np.asarray(column.flatten().flatten().to_numpy(), dtype=np.float32).reshape(-1, N, 64))
        tokens.append(table.column("token_ids").combine_chunks().flatten().to_numpy().reshape(-1, N))
    return torch.from_numpy(np.concatenate(acts)), torch.from_numpy(np.concatenate(tokens)).long()


@pytest.mark.parametrize("model_dtype, store", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "float16")])
def test_saelens_cache_on_the_gpu(capture_dirs, tmp_path, model_dtype, store):
    """The cache holds what the engine captures for each window alone (float32: HF's hidden states too)."""
    llm = LLM(capture_dirs["qwen3"], dtype=model_dtype, device="cuda", kv_cache_tokens=8192)
    steerable.capture_corpus(llm, TEXTS, tmp_path, format="saelens", context_size=N, layers=[1], dtype=store,
                             shard_size=5, batch_size=16)
    assert os.path.exists(tmp_path / "state.json")
    acts, tokens = read_cache(tmp_path)
    tok = llm.get_tokenizer()
    docs = (tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS)
    windows = torch.tensor(list(token_windows(docs, N, tok.bos_token_id)))
    assert torch.equal(tokens, windows)
    alone = steerable.capture(llm, windows[:6].tolist(), layers=[1], select="all", dtype=store).rows(1).float().cpu()
    ours = acts[:6].reshape(-1, 64)
    if model_dtype == "float32":  # batch invariant: each window as if alone
        assert torch.equal(ours, alone)
        with torch.no_grad():
            reference = hf_model(capture_dirs["qwen3"])(windows, output_hidden_states=True).hidden_states[2]
        assert (acts - reference).abs().max() <= 1e-4  # TF32-free fp32, other reduction orders
    else:  # bfloat16 GEMMs may tile a batch otherwise than one window
        assert (ours - alone).abs().max() <= 2e-2 * alone.abs().max()
    assert llm.capture_status()["graph_replays"] > 0
    llm.shutdown()
