"""pyreft's LoReFT interventions in the engine: ``steerable.vectors.load_reft`` reads what
``ReftModel.save`` wrote (pyreft makes and saves the interventions here, and its own forward is the
oracle); pyreft's layout written by hand with safetensors, positions split without shared weights,
against the formula; files that are not tensors and configurations it cannot serve are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, max_logprob_gap
from intervention_oracle import lowrank_delta, orthonormal_rows, plus, rand
from safetensors.torch import save_file

from steerable import LLM, LowRank, SamplingParams, SelectSpec
from steerable.vectors import load_reft

pyreft = pytest.importorskip("pyreft")

H = 64
LOREFT = "<class 'pyreft.interventions.LoreftIntervention'>"


@pytest.fixture(scope="module")
def llama(model_dirs):
    path = model_dirs["llama"]
    return LLM(path, device="cpu", kv_cache_tokens=4096), path


def _pyreft_model(path: str):
    """A pyreft model with two LoReFTs (layer 1's output, layer 2's input), their learned
    projections scaled up so they visibly change the output."""
    torch.manual_seed(0)
    model = hf_model(path)
    representations = [
        {"layer": 1, "component": "block_output", "low_rank_dimension": 4,
         "intervention": pyreft.LoreftIntervention(embed_dim=H, low_rank_dimension=4, dtype=torch.float32)},
        {"layer": 2, "component": "block_input", "low_rank_dimension": 2,
         "intervention": pyreft.LoreftIntervention(embed_dim=H, low_rank_dimension=2, dtype=torch.float32)}]
    reft = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations))
    with torch.no_grad():
        for intervention in reft.interventions.values():
            intervention.learned_source.weight.mul_(8.0)
            intervention.learned_source.bias.normal_(0, 2.0)
    return model, reft


def test_pyreft_save_loads_and_equals_pyreft_forward(llama, tmp_path):
    """Positions "f1+l1": pyreft intervenes on the first and last prompt tokens; every prompt
    position's next-token distribution (the engine's prompt logprobs) and the first generated
    token's equal pyreft's forward."""
    llm, path = llama
    model, reft = _pyreft_model(path)
    reft.save(str(tmp_path / "reft"))
    spec = load_reft(str(tmp_path / "reft"), positions="f1+l1")
    assert [(i.layer, i.hook, i.R.shape[0]) for i in spec.interventions] == [(1, "post_mlp", 4), (2, "pre_attn", 2)]
    assert spec.interventions[0].select == SelectSpec(prompt_positions=[0, -1])
    prompt = llm.get_tokenizer()(PROMPTS[5]).input_ids
    last = len(prompt) - 1
    with torch.no_grad():
        _, steered = reft({"input_ids": torch.tensor([prompt])},
                          unit_locations={"sources->base": (None, [[[0, last]], [[0, last]]])})
        plain = model(torch.tensor([prompt])).logits
    reference = torch.log_softmax(steered.logits[0].float(), -1)
    assert (reference - torch.log_softmax(plain[0].float(), -1)).abs().max() > 0.5, "the LoReFTs must matter"
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5, prompt_logprobs=5,
                                                steering_vectors=spec), use_tqdm=False)[0]
    gap = max(abs(lp.logprob - reference[position - 1, token].item())
              for position, entry in enumerate(out.prompt_logprobs) if entry is not None
              for token, lp in entry.items())
    assert gap <= 1e-4
    assert out.outputs[0].token_ids == [int(reference[last].argmax())]
    assert max_logprob_gap(out, reference[last:]) <= 1e-4


def _write_layout(root, sites, weights, binary=False) -> None:
    """pyreft's saved layout: pyvene's config.json and one weights file per intervention key."""
    os.makedirs(root, exist_ok=True)
    keys = [f"layer_{layer}_comp_{component}_unit_pos_nunit_1#{i}" for i, (layer, component) in enumerate(sites)]
    config = {"representations": [[layer, component, "pos", 1, w["weight"].shape[0]] + [None] * 9
                                  for (layer, component), w in zip(sites, weights)],
              "intervention_types": [LOREFT] * len(sites), "sorted_keys": keys, "mode": "parallel"}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f)
    for key, w in zip(keys, weights):
        if binary:
            torch.save(w, os.path.join(root, f"intkey_{key}.bin"))
        else:
            save_file(w, os.path.join(root, f"intkey_{key}.safetensors"))


def test_hand_written_layout_without_shared_weights_equals_the_formula(llama, tmp_path):
    """Two interventions, positions "f2+l1" not shared: the first acts on the first two prompt
    tokens, the second on the last one, each LoReFT's formula."""
    llm, path = llama
    weights, deltas = [], []
    for seed, rank in ((1, 3), (2, 2)):
        R, W, b = orthonormal_rows(rank, H, seed), rand(rank, H, seed=seed + 10, scale=2.0), rand(rank, seed=seed + 20)
        weights.append({"rotate_layer": R.T.contiguous(), "weight": W, "bias": b})
        deltas.append(lowrank_delta(R, W, b))
    _write_layout(tmp_path / "reft", [(0, "block_output"), (2, "model.layers[2].output")], weights)
    spec = load_reft(str(tmp_path / "reft"), positions="f2+l1", share_weights=False)
    first, last = SelectSpec(prompt_positions=[0, 1]), SelectSpec(prompt_positions=[-1])
    assert [i.select for i in spec.interventions] == [first, last]
    prompt = llm.get_tokenizer()(PROMPTS[1]).input_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5,
                                                steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf_model(path), [("post_mlp", 0, plus(deltas[0]), first),
                                                  ("post_mlp", 2, plus(deltas[1]), last)]).greedy(prompt, 6)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert load_reft(str(tmp_path / "reft")).interventions[0].select is None  # no positions: every token


class NotATensor:
    def __init__(self):
        self.payload = "code a loader would run"


def test_refused_files_and_configs(tmp_path):
    good = {"rotate_layer": orthonormal_rows(2, H, 1).T.contiguous(), "weight": rand(2, H, seed=2), "bias": rand(2, seed=3)}
    _write_layout(tmp_path / "pickled", [(1, "block_output")], [{**good, "bias": NotATensor()}], binary=True)
    with pytest.raises(ValueError, match=r"intkey_layer_1_comp_block_output_unit_pos_nunit_1#0\.bin: not a file of "
                                         r"tensors"):
        load_reft(str(tmp_path / "pickled"))
    _write_layout(tmp_path / "binary", [(1, "block_output")], [good], binary=True)
    assert isinstance(load_reft(str(tmp_path / "binary")).interventions[0], LowRank)
    _write_layout(tmp_path / "attention", [(1, "attention_output")], [good])
    with pytest.raises(ValueError, match=r"representations\[0\]\.component: 'attention_output'"):
        load_reft(str(tmp_path / "attention"))
    _write_layout(tmp_path / "noreft", [(1, "block_output")], [good])
    config = json.loads((tmp_path / "noreft" / "config.json").read_text())
    config["intervention_types"] = ["<class 'pyreft.interventions.NoreftIntervention'>"]
    (tmp_path / "noreft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only LoreftIntervention"):
        load_reft(str(tmp_path / "noreft"))
    _write_layout(tmp_path / "partial", [(1, "block_output")], [{"weight": good["weight"], "bias": good["bias"]}])
    with pytest.raises(ValueError, match="missing \\['rotate_layer'\\]"):
        load_reft(str(tmp_path / "partial"))
    with pytest.raises(ValueError, match="positions"):
        load_reft(str(tmp_path / "binary"), positions="first")
    with pytest.raises(ValueError, match="an odd number"):
        load_reft(str(tmp_path / "binary"), positions="f1+l1", share_weights=False)
    with pytest.raises(ValueError, match="config.json: not a pyreft save"):
        load_reft(str(tmp_path))
