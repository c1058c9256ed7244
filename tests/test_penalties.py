"""Repetition, presence and frequency penalties: equal to HF's logits processors (the repetition
penalty is HF's ``RepetitionPenaltyLogitsProcessor``; presence/frequency follow OpenAI's formula,
written here as an HF logits processor), on the logits and on whole greedy generations."""

import pytest
import torch
from conftest import hf_model
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from steerable import LLM, SamplingParams
from steerable.errors import InvalidRequestError
from steerable.worker.penalties import apply_penalties


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_penalties_equal_hf_processors_on_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    prompts = [[1, 2, 3], [4, 4, 9], [7]]
    outputs = [[3, 3, 10], [], [7, 8, 8, 8]]
    reps, freqs, pres = [1.3, 0.8, 1.0], [0.0, 0.5, -0.4], [0.0, 1.0, 0.7]
    ours = logits.clone()
    apply_penalties(ours, prompts, outputs, reps, freqs, pres)
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(reps[i])(ids, logits[i:i + 1].clone())
        ref = PresenceFrequency(len(prompts[i]), pres[i], freqs[i])(ids, ref)
        assert torch.allclose(ours[i], ref[0], atol=1e-6)
    assert not torch.equal(ours, logits)


@pytest.fixture(scope="module")
def pair(model_dirs):
    path = model_dirs["llama"]
    return LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.5), dict(repetition_penalty=0.7),
                                    dict(presence_penalty=1.5, frequency_penalty=0.8),
                                    dict(repetition_penalty=1.2, frequency_penalty=-0.5)])
def test_greedy_with_penalties_equals_hf(pair, kwargs):
    llm, hf = pair
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41], [100, 101, 102, 103]]
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kwargs),
                        use_tqdm=False)
    plain = llm.generate(prompts, base, use_tqdm=False)
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain))  # not a no-op
    for prompt, out in zip(prompts, outs):
        processors = LogitsProcessorList()
        if "repetition_penalty" in kwargs:
            processors.append(RepetitionPenaltyLogitsProcessor(kwargs["repetition_penalty"]))
        processors.append(PresenceFrequency(len(prompt), kwargs.get("presence_penalty", 0.0),
                                            kwargs.get("frequency_penalty", 0.0)))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                              logits_processor=processors)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("kwargs, field", [(dict(presence_penalty=2.5), "presence_penalty"),
                                           (dict(frequency_penalty=-3), "frequency_penalty"),
                                           (dict(repetition_penalty=0), "repetition_penalty"),
                                           (dict(repetition_penalty=float("nan")), "repetition_penalty")])
def test_bad_penalties(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)
