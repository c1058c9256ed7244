"""The engine pipe's output codec: increments decode to outputs equal to the engine's cumulative
ones at every step (growth, a stop string cut off the text, n=2 with logprobs, a streaming-input
restart sent whole, captures at the end), and nothing is held once a request has finished; folded
increments decode like their sequence, and the engine's sender folds what queues behind a slow
reader."""

from __future__ import annotations

import pickle
import threading

import torch

from steerable.entrypoints.engine_process import _Sender
from steerable.entrypoints.output_codec import OutputDecoder, OutputEncoder, merge_increments
from steerable.outputs import CompletionOutput, Logprob, RequestOutput


def _through_pipe(encoder: OutputEncoder, decoder: OutputDecoder, out: RequestOutput, whole: bool = False):
    sent = pickle.loads(pickle.dumps(encoder.encode(out, whole)))
    return decoder.decode(sent)


def _lp(token: int, value: float) -> dict:
    return {token: Logprob(value, 1, f"t{token}"), token + 1: Logprob(value - 1, 2, f"t{token + 1}")}


def test_increments_rebuild_every_cumulative_output():
    encoder, decoder = OutputEncoder(), OutputDecoder()
    prompt = [5, 6, 7]
    tokens: list[list[int]] = [[], []]
    texts = ["", ""]
    logprobs: list[list[dict]] = [[], []]
    for step in range(12):
        completions = []
        for index in range(2):
            finished = index == 0 and step >= 6  # the first completion stops early and keeps being reported
            if not finished:
                tokens[index].append(100 * index + step)
                texts[index] += f" w{step}"
                logprobs[index].append(_lp(100 * index + step, -0.1 * step))
            reason = "length" if finished else None
            completions.append(CompletionOutput(index, texts[index], list(tokens[index]), reason,
                                                list(logprobs[index]), None, -1.0 * step))
        out = RequestOutput("r", "a prompt", prompt, completions, False)
        assert _through_pipe(encoder, decoder, out) == out
    texts[1] = texts[1][:-4]  # a stop string cut off the end: the text shrinks
    captures = {"hidden_states": {0: torch.ones(3, 4)}}
    final = RequestOutput("r", "a prompt", prompt, [
        CompletionOutput(0, texts[0], list(tokens[0]), "length", list(logprobs[0]), None, -5.0),
        CompletionOutput(1, texts[1], list(tokens[1]), "stop", list(logprobs[1]), "w11", -11.0, captures, {})],
        True, captures, {})
    decoded = _through_pipe(encoder, decoder, final)
    assert decoded.outputs[1].text == texts[1] and decoded.outputs[1].stop_reason == "w11"
    assert torch.equal(decoded.captures["hidden_states"][0], captures["hidden_states"][0])
    assert decoded.outputs[0] == final.outputs[0] and decoded.finished
    assert not encoder._sent and not encoder._prompt_lens and not decoder._held and not decoder._prompts


def test_a_restarted_completion_goes_whole():
    """Streaming input: the next chunk restarts the completion and grows the prompt."""
    encoder, decoder = OutputEncoder(), OutputDecoder()
    first = RequestOutput("s", None, [1, 2], [CompletionOutput(0, "ab", [10, 11], "length")], False)
    assert _through_pipe(encoder, decoder, first, whole=True) == first
    second = RequestOutput("s", None, [1, 2, 10, 3], [CompletionOutput(0, "c", [12])], False)
    assert _through_pipe(encoder, decoder, second, whole=True) == second


def test_sends_only_what_is_new():
    encoder = OutputEncoder()
    prompt = list(range(1000))
    first = encoder.encode(RequestOutput("r", "p", prompt, [CompletionOutput(0, "x" * 50, list(range(50)))], False))
    later = encoder.encode(RequestOutput("r", "p", prompt, [CompletionOutput(0, "x" * 51, list(range(51)))], False))
    assert first[2] == ("p", prompt) and later[2] is None  # the prompt once
    assert later[3][0][2] == [50] and later[3][0][4] == "x"  # one token, one character
    assert len(pickle.dumps(later)) < 200


def _steps() -> list[RequestOutput]:
    """A request's cumulative outputs: n=2 with logprobs, the second completion's text cut back by a
    stop string at step 5, the first finishing at step 7 and then reported unchanged."""
    outs, tokens, texts, logprobs = [], [[], []], ["", ""], [[], []]
    for step in range(9):
        completions = []
        for index in range(2):
            finished = index == 0 and step >= 7
            if not finished:
                tokens[index].append(100 * index + step)
                texts[index] = texts[index][:-3] if index == 1 and step == 5 else texts[index] + f" w{step}"
                logprobs[index].append(_lp(100 * index + step, -0.1 * step))
            reason = "length" if finished else None
            completions.append(CompletionOutput(index, texts[index], list(tokens[index]), reason,
                                                list(logprobs[index]), None, -1.0 * step))
        outs.append(RequestOutput("r", "p", [1, 2, 3], completions, False))
    return outs


def test_merged_increments_decode_as_their_sequence():
    """However a run of increments is folded (any prefix sent alone, the rest merged), the decoder
    ends with the engine's output, text cut back by a stop string included."""
    outs = _steps()
    for split in range(len(outs)):
        encoder, decoder = OutputEncoder(), OutputDecoder()
        encoded = [encoder.encode(out) for out in outs]
        for head in encoded[:split]:
            decoder.decode(head)
        merged = encoded[split]
        for later in encoded[split + 1:]:
            merged = merge_increments(merged, later)
        assert decoder.decode(pickle.loads(pickle.dumps(merged))) == outs[-1]


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


def test_sender_folds_outputs_queued_behind_a_slow_reader():
    """Steps never wait for the pipe: what queues behind a send leaves as one message, one increment
    per mergeable request, a call's result keeps its place, and nothing is lost on close."""
    outs = _steps()
    encoder, pipe = OutputEncoder(), _SlowPipe()
    sender = _Sender(pipe)
    sender.send_outputs([(encoder.encode(outs[0]), True)])  # in flight while the rest queues
    assert pipe.sending.wait(10)
    for out in outs[1:5]:
        sender.send_outputs([(encoder.encode(out), True)])
    sender.send(("result", 7, "value", None))
    for out in outs[5:]:
        sender.send_outputs([(encoder.encode(out), True)])
    whole = OutputEncoder()
    sender.send_outputs([(whole.encode(RequestOutput("s", None, [1], [CompletionOutput(0, "a", [4])], False), True),
                          False)])
    sender.send_outputs([(whole.encode(RequestOutput("s", None, [1], [CompletionOutput(0, "b", [5])], False), True),
                          False)])
    pipe.release.set()
    sender.close()
    assert not sender.thread.is_alive()
    kinds = [message[0] for message in pipe.sent]
    assert kinds == ["outputs", "outputs", "result", "outputs"], kinds
    assert [len(message[1]) for message in pipe.sent if message[0] == "outputs"] == [1, 1, 3]
    decoder = OutputDecoder()
    decoded = [decoder.decode(encoded) for message in pipe.sent if message[0] == "outputs" for encoded in message[1]]
    assert decoded[1] == outs[4] and decoded[2] == outs[-1]
    assert [d.outputs[0].text for d in decoded[3:]] == ["a", "b"]  # a streaming-input request's outputs stay apart
