"""``AsyncLLM`` (issue 10): the engine steps in its own thread, concurrent requests batch together,
cancelling a consumer aborts its request within one step, the thread sleeps when idle, and
streaming input grows a request that keeps its steering and capture and delivers no row twice."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from steerable import LLM, AsyncLLM, CaptureSpec, SamplingParams, StreamingInput
from steerable.capture import match_capture_request_id
from steerable.entrypoints.engine_process import ProcessAsyncLLM
from steerable.errors import EngineDeadError, InvalidRequestError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[AsyncLLM, ProcessAsyncLLM], ids=["thread", "process"])
def llm(request, model_dirs):
    """Every test runs against the engine on a thread and against the engine in its own process
    (what ``steerable serve`` runs)."""
    with request.param(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def offline(model_dirs):
    return LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)


async def last(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None):
    outs = [out async for out in llm.generate(prompt, params, request_id=request_id)]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs[-1]


async def wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = await llm.stats()
        if stats["num_requests"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.01)


def assert_nothing_held(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["steering_rows_in_use"] == stats["capture_requests_in_use"] == stats["num_paused"] == 0, stats


def test_concurrent_generates_batch_and_match_offline(llm, offline):
    prompts = [[10 + i, 20, 30 + 2 * i, 40] for i in range(12)]
    params = SamplingParams(max_tokens=8, **GREEDY)

    async def main():
        before = (await llm.stats())["num_steps"]
        outs = await asyncio.gather(*[last(llm, p, params, f"r{i}") for i, p in enumerate(prompts)])
        return outs, (await llm.stats())["num_steps"] - before

    outs, steps = asyncio.run(main())
    ref = offline.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.request_id for o in outs] == [f"r{i}" for i in range(12)]
    assert steps < 3 * 8  # 96 tokens in a few batched steps, not one request after another


def test_a_slow_consumer_takes_whole_snapshots_and_ends_with_the_offline_result(llm, offline):
    """A consumer that falls behind skips intermediate outputs (the process variant folds the
    engine's increments until it takes one); every output it takes is a whole cumulative snapshot
    that later ones do not change, and the last equals offline (n=2, logprobs)."""
    prompt = [11, 22, 33, 44, 55]
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, seed=5, logprobs=1, ignore_eos=True)

    async def main():
        taken = []
        async for out in llm.generate(prompt, params):
            taken.append((out, [(list(c.token_ids), c.text, len(c.logprobs)) for c in out.outputs]))
            await asyncio.sleep(0.05)
        return taken

    taken = asyncio.run(main())
    ref = offline.generate([prompt], params, use_tqdm=False)[0]
    final = taken[-1][0]
    assert [(c.token_ids, c.text) for c in final.outputs] == [(c.token_ids, c.text) for c in ref.outputs]
    for c, whole in zip(final.outputs, ref.outputs):
        assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == \
            pytest.approx([lp[t].logprob for t, lp in zip(whole.token_ids, whole.logprobs)], abs=1e-5)
    assert len(taken) < 24  # it skipped outputs
    for out, when_taken in taken:
        assert [(list(c.token_ids), c.text, len(c.logprobs)) for c in out.outputs] == when_taken  # not changed since
        for c, whole in zip(out.outputs, ref.outputs):
            assert len(c.logprobs) == len(c.token_ids) and c.token_ids == whole.token_ids[:len(c.token_ids)]
            assert whole.text.startswith(c.text)


def test_cancelling_the_consumer_aborts_within_one_step(llm):
    async def main():
        seen = []

        async def consume():
            async for out in llm.generate("Hello world", SamplingParams(max_tokens=400, **GREEDY),
                                          request_id="cancelled"):
                seen.append(len(out.outputs[0].token_ids))
                if len(seen) == 3:
                    started.set()

        started = asyncio.Event()
        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        steps = (await llm.stats())["num_steps"]  # read after the queued abort, before the next step
        stats = await wait_idle(llm)
        return seen, stats["num_steps"] - steps, stats

    seen, steps_after, stats = asyncio.run(main())
    assert steps_after <= 1 and seen[-1] < 400
    assert_nothing_held(stats)


def test_abort_by_id_ends_the_stream(llm):
    async def main():
        outs = []

        async def consume():
            async for out in llm.generate("Hello", SamplingParams(max_tokens=400, **GREEDY), request_id="a1"):
                outs.append(out)
                if len(outs) == 2:
                    await llm.abort("a1")

        await asyncio.wait_for(consume(), 30)
        return outs, await wait_idle(llm)

    outs, stats = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert_nothing_held(stats)


def test_control_plane_is_awaitable(llm, offline):
    v = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        plain = await last(llm, "Steering", params)
        await llm.set_steering_vectors({1: v})
        status = await llm.get_steering_status()
        steered = await last(llm, "Steering", params)
        await llm.clear_steering_vectors()
        await llm.start_capture(layers=[2], select="last_prompt")
        captured = await last(llm, "Steering", params)
        tensors, metas = await llm.fetch_captured(clear=True)
        await llm.stop_capture()
        return plain, status, steered, captured, tensors, metas, await llm.list_steerable_layers()

    plain, status, steered, captured, tensors, metas, layers = asyncio.run(main())
    offline.set_steering_vectors({1: v})
    try:
        ref = offline.generate("Steering", params, use_tqdm=False)[0]
    finally:
        offline.clear_steering_vectors()
    assert status["global"]["interventions"] == 1 and layers["post_mlp"] == [0, 1, 2]
    assert steered.outputs[0].token_ids == ref.outputs[0].token_ids != plain.outputs[0].token_ids
    assert captured.outputs[0].token_ids == plain.outputs[0].token_ids
    assert tensors[2].shape == (1, 64) and match_capture_request_id(metas[2].req_ids[0], captured.request_id)


def test_idle_engine_thread_sleeps(llm):
    async def main():
        await last(llm, "Hello", SamplingParams(max_tokens=2, **GREEDY))
        steps, cpu = (await llm.stats())["num_steps"], time.process_time()
        await asyncio.sleep(0.5)  # the measurement window: nothing is submitted
        cpu = time.process_time() - cpu  # this process: the engine thread, or the reader of the engine's pipe
        return (await llm.stats())["num_steps"] - steps, cpu

    steps, cpu = asyncio.run(main())
    assert steps == 0 and cpu < 0.1


def test_bad_requests_raise_before_any_output(llm):
    async def main():
        with pytest.raises(InvalidRequestError, match="steering_vectors"):
            await llm.add_request("bad", "Hello", SamplingParams(steering_vectors={1: [1.0, 2.0]}))
        with pytest.raises(InvalidRequestError, match="prompt"):
            await llm.add_request("bad", {"text": "Hello"})
        stream = await llm.add_request("dup", "Hello", SamplingParams(max_tokens=50, **GREEDY))
        with pytest.raises(InvalidRequestError, match="request_id"):
            await llm.add_request("dup", "Hello")
        stream.close()
        return await wait_idle(llm)

    assert_nothing_held(asyncio.run(main()))


# ---------------------------------------------------------------- streaming input

def test_streaming_input_keeps_steering_and_capture_and_delivers_no_row_twice(llm, offline):
    """Three chunks: token ids (the chunk ends on max_tokens), text (it ends on a stop token, whose
    row the engine computes in flight and must drop), token ids with their own sampling. A capture
    stream and the request's CaptureSpec record every row: each position arrives exactly once."""
    tok = offline.get_tokenizer()
    v = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    steering = {"pre_attn": {1: v}}

    def steered(**kwargs) -> SamplingParams:
        return SamplingParams(steering_vectors=steering, **kwargs)

    def oracle(prompt: list[int], params: SamplingParams) -> list[int]:
        return offline.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    # The expected session, chunk by chunk: the cumulative prompt drops each chunk's last token.
    first, text, last_ids = tok("Hello world").input_ids, " the quick brown fox", [50, 51, 52]
    gen1 = oracle(first, steered(max_tokens=3, **GREEDY))
    prompt2 = first + gen1[:-1] + tok(text, add_special_tokens=False).input_ids
    stop = oracle(prompt2, steered(max_tokens=6, **GREEDY))[2]
    chunk2 = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop])
    gen2 = oracle(prompt2, steered(max_tokens=6, temperature=0, stop_token_ids=[stop]))
    prompt3 = prompt2 + gen2[:-1] + last_ids
    chunk3 = SamplingParams(max_tokens=4, **GREEDY)
    gen3 = oracle(prompt3, steered(max_tokens=4, **GREEDY))
    assert gen2[-1] == stop and gen3 != oracle(prompt3, chunk3)  # the stop token ends chunk 2; steering matters

    session = steered(max_tokens=3, capture=CaptureSpec(layers=[0, 2]), **GREEDY)

    async def chunks():
        yield first
        await asyncio.sleep(0.01)  # later chunks arrive while the first one generates
        yield StreamingInput(text, chunk2)
        yield StreamingInput(last_ids, chunk3)

    async def main():
        await llm.start_capture(layers=[2])
        try:
            outs = [out async for out in llm.generate(chunks(), session, request_id="grow")]
            tensors, metas = await llm.fetch_captured(clear=True)
        finally:
            await llm.stop_capture()
        return outs, tensors, metas, await wait_idle(llm)

    outs, stream_rows, stream_meta, stats = asyncio.run(main())
    final = outs[-1]
    assert final.finished and sum(o.finished for o in outs) == 1
    assert final.prompt_token_ids == prompt3 and final.outputs[0].token_ids == gen1 + gen2 + gen3
    assert_nothing_held(stats)

    sequence = prompt3 + gen3
    own, own_meta = final.captures["hidden_states"], final.capture_meta["hidden_states"]
    for layer in (0, 2):  # every input row of the final sequence, once, labelled with its token
        assert own_meta[layer].positions.tolist() == list(range(len(sequence) - 1))
        assert own_meta[layer].token_ids.tolist() == sequence[:-1]
    mine = [i for i, label in enumerate(stream_meta[2].req_ids) if match_capture_request_id(label, "grow")]
    assert stream_meta[2].positions[mine].tolist() == list(range(len(sequence) - 1))
    assert torch.equal(stream_rows[2][mine], own[2])
    ref = offline.generate(prompt3, steered(max_tokens=4, capture=CaptureSpec(layers=[0, 2]), **GREEDY),
                           use_tqdm=False)[0]
    for layer in (0, 2):  # chunk by chunk versus one prefill: the same values up to float32 rounding
        torch.testing.assert_close(own[layer], ref.captures["hidden_states"][layer], rtol=0, atol=1e-4)


def test_streaming_input_refuses_a_chunk_that_changes_steering(llm):
    async def chunks():
        yield [5, 6, 7]
        yield StreamingInput([8], SamplingParams(max_tokens=2, steering_vectors={1: [0.0] * 64}))

    async def main():
        with pytest.raises(InvalidRequestError, match="steering_vectors"):
            async for _ in llm.generate(chunks(), SamplingParams(max_tokens=2, **GREEDY)):
                pass
        return await wait_idle(llm)

    assert_nothing_held(asyncio.run(main()))


@pytest.mark.parametrize("kind", [AsyncLLM, ProcessAsyncLLM], ids=["thread", "process"])
def test_shutdown_fails_open_streams_and_later_calls(model_dirs, kind):
    async def main():
        llm = kind(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024)
        stream = await llm.add_request("open", "Hello", SamplingParams(max_tokens=400, **GREEDY))
        await stream.__anext__()
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "Hello")
        llm.shutdown()  # idempotent
        return llm.dead

    assert isinstance(asyncio.run(main()), EngineDeadError)


def test_engine_process_death_fails_streams_and_leaves_no_process(model_dirs):
    """A killed engine process: the open stream and later calls fail with EngineDeadError within
    seconds, and shutdown leaves no child behind."""
    import multiprocessing

    async def main():
        llm = ProcessAsyncLLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024)
        stream = await llm.add_request("open", "Hello", SamplingParams(max_tokens=400, **GREEDY))
        await stream.__anext__()
        llm._proc.kill()

        async def drain():  # outputs the engine sent before it died may still be in the pipe
            async for out in stream:
                assert not out.finished

        with pytest.raises(EngineDeadError, match=r"killed by signal 9 \(SIGKILL\)"):
            await asyncio.wait_for(drain(), 30)
        with pytest.raises(EngineDeadError):
            await llm.stats()
        llm.shutdown()
        return llm._proc

    child = asyncio.run(main())
    assert not child.is_alive() and child not in multiprocessing.active_children()


def test_engine_process_refuses_consumers_and_keeps_error_types(model_dirs):
    async def main():
        async with ProcessAsyncLLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024) as llm:
            with pytest.raises(ValueError, match="consumer"):
                await llm.add_capture_consumer(lambda rows: None)
            with pytest.raises(InvalidRequestError):  # raised in the engine process, same type here
                await llm.set_steering_vectors({1: [1.0, 2.0]})
            return await llm.stats()

    assert asyncio.run(main())["num_requests"] == 0
