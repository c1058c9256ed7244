"""Tool-call and reasoning parsers (issue 48 §9-10) on scripted model outputs: each format's
calls and content as vLLM's parser of that name reads them, and a streamed choice (fed character
by character, and in token-sized pieces) adding up to exactly the message of the whole text."""

from __future__ import annotations

import json
import random

import pytest

from steerable.entrypoints.openai.chat_message import AssistantText
from steerable.entrypoints.openai.reasoning import REASONING_PARSERS
from steerable.entrypoints.openai.tool_parsers import TOOL_PARSERS
from steerable.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON, read_json

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "noop"}}]
WEATHER = {"city": "Paris \"Île\" \\ 😀", "days": 3, "metric": True, "hours": [1.5, None, {"a": []}]}

OUTPUTS = {  # (model output, content, [(name, arguments)])
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               + json.dumps(WEATHER, separators=(",", ":")) + '}\n</tool_call>\n<tool_call>\n'
               '[{"name": "noop", "arguments": {}}]\n</tool_call>',
               "Let me look.", [("get_weather", WEATHER), ("noop", {})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER, indent=1)
                    + '} ; {"name": "noop", "parameters": {}}', None, [("get_weather", WEATHER), ("noop", {})]),
    "mistral": ('Sure [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]",
                "Sure", [("get_weather", WEATHER)]),
    "qwen3_coder": ("I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n" + WEATHER["city"]
                    + "\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
                      "<parameter=hours>\n[1.5, null, {\"a\": []}]\n</parameter>\n</function>\n</tool_call>",
                    "I will call it.", [("get_weather", WEATHER)]),
}


def streamed(parsers: AssistantText, text: str, cuts: list[int]) -> dict:
    """The message a client assembles from the deltas of ``text`` fed in pieces ending at ``cuts``."""
    stream = parsers.stream()
    content, reasoning, calls = "", "", {}
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        delta = stream.feed(text[start:end], final=end == len(text))
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function" and call["index"] == len(calls)
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return {"content": content or None, "reasoning": reasoning or None, "calls": [calls[k] for k in sorted(calls)]}


def cut_points(text: str, seed: int) -> list[list[int]]:
    """Every character, and random token-sized pieces."""
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        at += rng.randint(1, 6)
        pieces.append(min(at, len(text)))
    return [list(range(1, len(text))), pieces[:-1]]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_format_whole_and_streamed(name):
    text, content, calls = OUTPUTS[name]
    parsers = AssistantText(None, TOOL_PARSERS[name](TOOLS))
    message, called = parsers.message(text)
    assert called and message["content"] == content and message["role"] == "assistant"
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == calls
    for c in message["tool_calls"]:  # vLLM's arguments string: json.dumps of the arguments
        assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
        assert c["type"] == "function"
        assert (len(c["id"]) == 9 and c["id"].isalnum()) if name == "mistral" else c["id"].startswith("chatcmpl-tool-")
    for cuts in cut_points(text, seed=len(text)):
        stream = streamed(parsers, text, cuts)
        assert stream["content"] == content
        assert [(c["name"], c["arguments"]) for c in stream["calls"]] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_plain_answers_stay_content(name):
    text = "The weather in Paris is mild; {braces} and <tags> stay text."
    parsers = AssistantText(None, TOOL_PARSERS[name](TOOLS))
    message, called = parsers.message(text)
    assert not called and message["content"] == text and message["tool_calls"] == []
    for cuts in cut_points(text, seed=1):
        assert streamed(parsers, text, cuts) == {"content": text, "reasoning": None, "calls": []}


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("mistral", "[TOOL_CALLS]oops"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),  # cut off
])
def test_malformed_calls_come_back_as_content(name, text):
    message, called = AssistantText(None, TOOL_PARSERS[name](TOOLS)).message(text)
    assert not called and message["content"] == text and message["tool_calls"] == []


def test_mistral_v11_and_llama_text_forms():
    text = '[TOOL_CALLS]get_weather{"city": "Rome"}[TOOL_CALLS]noop[ARGS]{}'
    message, _ = AssistantText(None, TOOL_PARSERS["mistral"](TOOLS)).message(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Rome"}'), ("noop", "{}")]
    message, called = AssistantText(None, TOOL_PARSERS["llama3_json"](TOOLS)).message("It is sunny.")
    assert not called and message["content"] == "It is sunny."


def test_forced_choices_read_the_grammar_json():
    named = AssistantText(None, NamedToolParser("get_weather", TOOLS), forced=True)
    message, called = named.message('{ "city" :"Oslo"}')
    assert called and message["content"] == "" and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = AssistantText(None, RequiredToolParser(TOOLS), forced=True)
    text = '[{"name": "noop", "parameters": {}}, {"name": "get_weather", "parameters": {"days": 2}}]'
    message, called = required.message(text)
    assert called and [c["function"]["name"] for c in message["tool_calls"]] == ["noop", "get_weather"]
    for cuts in cut_points(text, seed=3):
        assert [c["arguments"] for c in streamed(required, text, cuts)["calls"]] == ["{}", '{"days": 2}']
    schema = required_schema(TOOLS)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2


THINKING = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_split_whole_and_streamed(name):
    parsers = AssistantText(REASONING_PARSERS[name]("<|im_start|>assistant\n"))
    message, _ = parsers.message(THINKING)
    assert message["reasoning_content"] == message["reasoning"] == "\nThe user wants weather.\n"
    assert message["content"] == "\n\nIt is sunny."
    for cuts in cut_points(THINKING, seed=2):
        assert streamed(parsers, THINKING, cuts) == {"content": "\n\nIt is sunny.",
                                                      "reasoning": "\nThe user wants weather.\n", "calls": []}
    # The template opened the block in the prompt: no start tag in the answer.
    no_start = THINKING.removeprefix("<think>")
    assert parsers.message(no_start)[0]["reasoning_content"] == "\nThe user wants weather.\n"
    # Cut short while thinking: all reasoning, no content.
    cut = parsers.message("<think>\nStill thinking")[0]
    assert cut["reasoning_content"] == "\nStill thinking" and cut["content"] is None


def test_reasoning_off_and_with_tools():
    off = AssistantText(REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n", {"enable_thinking": False}))
    assert off.message("Plain answer.")[0] == {**off.message("Plain answer.")[0], "content": "Plain answer.",
                                               "reasoning_content": None}
    closed = AssistantText(REASONING_PARSERS["deepseek_r1"]("<think>\n\n</think>\n\n"))  # the prompt closed it
    assert closed.message("Plain answer.")[0]["content"] == "Plain answer."
    hidden = AssistantText(REASONING_PARSERS["qwen3"](""), include_reasoning=False)
    assert hidden.message(THINKING)[0]["reasoning_content"] is None
    both = AssistantText(REASONING_PARSERS["qwen3"](""), TOOL_PARSERS["hermes"](TOOLS))
    text = '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    message, called = both.message(text)
    assert called and message["reasoning_content"] == "\nCall it.\n" and message["content"] is None
    for cuts in cut_points(text, seed=4):
        got = streamed(both, text, cuts)
        assert got["reasoning"] == "\nCall it.\n" and got["content"] is None and got["calls"][0]["name"] == "noop"
    grammar = AssistantText(REASONING_PARSERS["qwen3"]("", needs_start=True))
    assert grammar.message('{"a": 1}')[0]["content"] == '{"a": 1}'
    assert grammar.message(THINKING)[0]["content"] == "\n\nIt is sunny."


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "lit", "list", "dict"] if depth < 3 else ["str", "int", "lit"])
    if kind == "str":
        return "".join(rng.choice('ab "\\\n\té😀\u2028') for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([1.5, -0.25, 1e-7, 3.0e21])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_json_prefix_canonical_only_grows_to_json_dumps():
    rng = random.Random(0)
    for trial in range(60):
        value = {"v": _random_json(rng)}
        text = json.dumps(value, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5,
                          separators=rng.choice([None, (",", ":")]))
        want = json.dumps(value, ensure_ascii=False)
        seen = ""
        for end in range(len(text) + 1):
            node = read_json(text[:end])
            got = "" if node is None else node.canonical()
            assert got.startswith(seen) and want.startswith(got), (text[:end], got)
            seen = got
        assert seen == want
    for bad in ('{"a" 1}', "[1 2]", '{"a": tru e}', "nope"):
        with pytest.raises(MalformedJSON):
            read_json(bad)
