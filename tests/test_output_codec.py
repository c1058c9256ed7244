"""The engine pipe: the engine's increments, pickled and decoded, equal its cumulative outputs at
every step (n=2 with logprobs, a stop string cutting the text back, captures at the end, a
streaming-input restart, an abort), an increment carries only what is new, nothing is held once a
request has finished, folded increments decode like their sequence, and the engine's sender folds
what queues behind a slow reader."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from conftest import PROMPTS

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.engine.output_processor import OutputProcessor
from steerable.entrypoints.engine_process import _Sender
from steerable.entrypoints.output_codec import OutputDecoder, merge_increments
from steerable.outputs import RequestOutput


@pytest.fixture(scope="module")
def engine(model_dirs):
    return LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=4096).engine


def _same(decoded: RequestOutput, expected: RequestOutput) -> None:
    """Equal outputs; capture tensors compared by value."""
    def bare(out: RequestOutput) -> RequestOutput:
        from dataclasses import replace
        return replace(out, captures={}, capture_meta={}, outputs=[replace(c, captures={}, capture_meta={})
                                                                   for c in out.outputs])

    assert bare(decoded) == bare(expected)
    for got, want in [(decoded, expected)] + list(zip(decoded.outputs, expected.outputs)):
        assert got.captures.keys() == want.captures.keys() and got.capture_meta == want.capture_meta
        for stream in want.captures:
            for layer, rows in want.captures[stream].items():
                assert torch.equal(got.captures[stream][layer], rows)


def _run(engine, admit) -> list[tuple[tuple, RequestOutput]]:
    """Step until done; each report as (increment through pickle, the cumulative output then)."""
    groups = admit()
    reports = []
    while engine.has_unfinished_requests():
        step = engine.step()
        assert len({increment[0] for increment in step}) == len(step)  # a group once per step, n=2 too
        for increment in step:
            group = groups[increment[0]]
            reports.append((pickle.loads(pickle.dumps(increment)), OutputProcessor.output(group)))
    return reports


def _stop_string(engine) -> str:
    """Three characters from the middle of the greedy text, so the text is cut back when they appear."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("probe", PROMPTS[0], greedy)
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    return text[3:6]


def _mixed(engine) -> list[tuple[tuple, RequestOutput]]:
    stop = _stop_string(engine)
    params = {"n2": SamplingParams(n=2, max_tokens=9, temperature=0.8, seed=3, logprobs=2, ignore_eos=True),
              "stopped": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop),
              "captured": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                         capture=CaptureSpec(layers=[0, 1], select="all"))}

    def admit():  # "stopped" on the probe's prompt
        return {rid: engine.add_request(rid, PROMPTS[i], p, stream=True, increments=True)
                for i, (rid, p) in zip((1, 0, 2), params.items())}
    return _run(engine, admit)


def test_increments_rebuild_every_cumulative_output(engine):
    reports = _mixed(engine)
    decoder = OutputDecoder()
    for increment, expected in reports:
        _same(decoder.decode(increment), expected)
    finals = {inc[0]: out for inc, out in reports if out.finished}
    assert finals.keys() == {"n2", "stopped", "captured"}
    assert finals["stopped"].outputs[0].finish_reason == "stop"  # the text was cut back (effect check)
    assert finals["captured"].captures["hidden_states"][1].shape[0] > 5
    assert len(finals["n2"].outputs) == 2 and len(finals["n2"].outputs[1].logprobs) == 9
    assert not decoder._held and not decoder._prompts


def test_an_increment_carries_only_what_is_new(engine):
    prompt = [3 + i % 300 for i in range(400)]
    reports = _run(engine, lambda: {"long": engine.add_request(
        "long", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), stream=True,
        increments=True)})
    first, later = reports[0][0], reports[2][0]
    assert first[2] == (None, prompt, None, 0) and later[2] is None  # the prompt once (no prefix-cache hit)
    assert len(later[3][0][2]) == 1 and later[3][0][1] == 2  # one token, written after the two before it
    assert len(pickle.dumps(later)) < 200


def test_a_streaming_input_restart_and_an_abort(engine):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    groups = {"s": engine.add_request("s", PROMPTS[1], params, stream=True, resumable=True, increments=True),
              "v": engine.add_request("v", PROMPTS[2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                                      stream=True, increments=True)}
    decoder = OutputDecoder()
    sent = []

    def take(increments):
        for increment in increments:
            sent.append(increment)
            expected = OutputProcessor.output(groups[increment[0]])
            _same(decoder.decode(pickle.loads(pickle.dumps(increment))), expected)

    engine.extend_request("s", " and then", params)
    take(engine.close_request_input("s"))
    take(engine.step())
    take(engine.abort_request("v"))
    while engine.has_unfinished_requests():
        take(engine.step())
    assert groups["s"].finished and groups["v"].children[0].finish_reason == "abort"
    session = [inc for inc in sent if inc[0] == "s"]
    prompts = [i for i, inc in enumerate(session) if inc[2] is not None]
    assert len(prompts) == 2 and session[prompts[1]][3][0][1] == 0  # the second chunk restarts the completion
    assert not decoder._held and not decoder._prompts


def test_folded_increments_decode_as_their_sequence(engine):
    """However a run of increments is folded (any prefix sent alone, the rest merged), the decoder
    ends with the engine's output, text cut back by a stop string included."""
    reports = _mixed(engine)
    for rid in ("n2", "stopped"):
        run = [(inc, out) for inc, out in reports if inc[0] == rid]
        for split in range(len(run)):
            decoder = OutputDecoder()
            for head, _ in run[:split]:
                decoder.decode(head)
            merged = run[split][0]
            for later, _ in run[split + 1:]:
                merged = merge_increments(merged, later)
            _same(decoder.decode(pickle.loads(pickle.dumps(merged))), run[-1][1])


class _SlowPipe:
    """A pipe end whose sends wait until released, recording each message."""

    def __init__(self) -> None:
        self.sent: list = []
        self.sending = threading.Event()
        self.release = threading.Event()

    def send(self, message) -> None:
        self.sending.set()
        self.release.wait(10)
        self.sent.append(pickle.loads(pickle.dumps(message)))


def test_sender_folds_outputs_queued_behind_a_slow_reader(engine):
    """Steps never wait for the pipe: what queues behind a send leaves as one message, one increment
    per mergeable request, a call's result keeps its place, and nothing is lost on close."""
    run = [(inc, out) for inc, out in _mixed(engine) if inc[0] == "n2"]
    assert len(run) >= 7
    pipe = _SlowPipe()
    sender = _Sender(pipe)
    sender.send_outputs([(run[0][0], True)])  # in flight while the rest queues
    assert pipe.sending.wait(10)
    for increment, _ in run[1:5]:
        sender.send_outputs([(increment, True)])
    sender.send(("result", 7, "value", None))
    for increment, _ in run[5:]:
        sender.send_outputs([(increment, True)])
    apart = [(("s", False, (None, [1], None, 0), ((0, at, [4 + at], at, "ab"[at], 0, None, None, None, None, None, None),),
               None, None), False) for at in (0, 1)]
    sender.send_outputs(apart[:1])
    sender.send_outputs(apart[1:])
    pipe.release.set()
    sender.close()
    assert not sender.thread.is_alive()
    kinds = [message[0] for message in pipe.sent]
    assert kinds == ["outputs", "outputs", "result", "outputs"], kinds
    assert [len(message[1]) for message in pipe.sent if message[0] == "outputs"] == [1, 1, 3]
    decoder = OutputDecoder()
    decoded = [decoder.decode(increment) for message in pipe.sent if message[0] == "outputs"
               for increment in message[1]]
    _same(decoded[1], run[4][1])
    _same(decoded[2], run[-1][1])
    assert [d.outputs[0].text for d in decoded[3:]] == ["a", "ab"]  # a streaming-input request's outputs stay apart
