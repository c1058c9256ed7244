"""``logprob_token_ids`` (the listed ids' logprob and rank at every sampled position) and
``logprobs=-1`` (every vocabulary entry), checked against HF log-softmax of the same sequence."""

import pytest
import torch
from conftest import PROMPTS, hf_model

from steerable import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(capture_dirs):
    return LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def hf(capture_dirs):
    return hf_model(capture_dirs["llama"])


def hf_logprobs(hf, prompt_ids, output_ids):
    """log-softmax at each sampled position (the prompt's last token, then each generated input)."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output_ids)], dim=-1)


def test_listed_ids_at_every_position(llm, hf):
    listed = [5, 17, 200]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                  logprob_token_ids=listed), use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(hf, out.prompt_token_ids, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert set(entry) == {token, *listed}  # logprobs=0 implied: nothing else
        for t in entry:
            assert entry[t].logprob == pytest.approx(float(ref[step, t]), abs=1e-4)
            assert entry[t].rank == int((ref[step] > ref[step, t]).sum()) + 1


def test_listed_ids_add_to_top_n():
    params = SamplingParams(logprobs=3, logprob_token_ids=[9])
    assert params.logprobs == 3 and params.logprob_token_ids == [9]
    assert SamplingParams(logprob_token_ids=(4, 9)).logprobs == 0


def test_every_vocabulary_entry(llm, hf):
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=-1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(hf, out.prompt_token_ids, completion.token_ids)
    for step, entry in enumerate(completion.logprobs):
        assert sorted(entry) == list(range(vocab))
        values = torch.tensor([entry[t].logprob for t in range(vocab)])
        assert torch.allclose(values, ref[step], atol=1e-4)
        assert float(values.exp().sum()) == pytest.approx(1.0, abs=1e-4)
        ranks = torch.tensor([entry[t].rank for t in range(vocab)])
        assert torch.equal(ranks, (ref[step][None, :] > ref[step][:, None]).sum(dim=1) + 1)
        assert entry[completion.token_ids[step]].rank == 1  # greedy picks the top entry
        assert entry[5].decoded_token == llm.get_tokenizer().decode([5])


@pytest.mark.parametrize("ids", [[-1], [1.5], "7"])
def test_bad_listed_ids(ids):
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=ids)


def test_listed_id_outside_vocabulary_admits_nothing(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logprob_token_ids"):
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(logprob_token_ids=[vocab])],
                     use_tqdm=False)
    stats = llm.engine.stats()
    assert not llm.engine.requests and stats["num_free_blocks"] == stats["num_blocks"]
