"""The server under load (issue 10): 1,000 requests at concurrency 32 over loopback, 10 % invalid
of every kind, 10 % disconnecting mid-stream. Every valid answer equals offline, every invalid one
gets its 4xx, and afterwards nothing is held (asserted through /metrics and GET /v1/steering)."""

from __future__ import annotations

import asyncio
import random

import httpx
import torch
from server_harness import MAX_BODY_BYTES, USER, assert_nothing_held

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.capture import deserialize_captured

PROMPTS = ["Hello world", "The quick brown fox jumps", "Steering vectors shift", "Paged attention stores keys"]


def soak_requests(n: int, rng: random.Random) -> list[tuple[str, dict | bytes]]:
    """n requests: 10 % invalid (each kind in turn), 10 % that disconnect mid-stream, the rest valid."""
    bad = [({"prompt": "x", "steering_vectors": {"1": [1.0, 2.0]}}, 400),
           ({"prompt": "x", "steering_module_ref": "missing"}, 400),
           ({"prompt": "x", "capture": {"select": {"generation_window": [3, 1]}}}, 400),
           (b'{"prompt": [1, 2', 400),
           (b'{"prompt": "' + b"y" * (MAX_BODY_BYTES + 1) + b'"}', 413)]
    out = []
    for i in range(n):
        if i % 10 == 3:
            out.append(("bad", bad[(i // 10) % len(bad)]))
        elif i % 10 == 7:
            out.append(("drop", {"prompt": PROMPTS[i % 4], "max_tokens": 64, "ignore_eos": True, "stream": True,
                                 "steering_vectors": {"2": [0.25] * 64}}))
        else:
            out.append(("good", rng.randrange(len(SOAK_CASES))))
    return out


SOAK_CASES = [(p, steer, cap) for p in PROMPTS for steer in (None, 1.5) for cap in (False, True)]


def soak_expected(offline: LLM) -> list:
    """Each case's answer offline."""
    params = [SamplingParams(max_tokens=5, temperature=0,
                             steering_vectors={1: torch.full((64,), steer)} if steer else None,
                             capture=CaptureSpec(layers=[2], select="all_generated") if cap else None)
              for _, steer, cap in SOAK_CASES]
    return offline.generate([prompt for prompt, _, _ in SOAK_CASES], params, use_tqdm=False)


def test_soak(server, http, offline):
    """1,000 requests at concurrency 32 over loopback; every valid answer equals offline, every
    invalid one gets its 4xx, disconnected streams leave nothing behind."""
    expected = soak_expected(offline)
    plan = soak_requests(1000, random.Random(0))
    counts = {"good": 0, "bad": 0, "drop": 0}

    async def one(client: httpx.AsyncClient, kind: str, payload) -> None:
        if kind == "bad":
            body, status = payload
            kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
            r = await client.post("/v1/completions", headers={**USER, "Content-Type": "application/json"}, **kwargs)
            assert r.status_code == status, r.text[:300]
        elif kind == "drop":
            async with client.stream("POST", "/v1/completions", json=payload, headers=USER) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break
        else:
            prompt, steer, cap = SOAK_CASES[payload]
            body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
            if steer:
                body["steering_vectors"] = {"1": [steer] * 64}
            if cap:
                body["capture"] = {"layers": [2], "select": "all_generated"}
            r = await client.post("/v1/completions", json=body, headers=USER)
            assert r.status_code == 200, r.text[:300]
            choice, ref = r.json()["choices"][0], expected[payload].outputs[0]
            assert choice["token_ids"] == ref.token_ids
            if cap:
                tensors, metas = deserialize_captured(choice["captures"]["hidden_states"])
                assert torch.equal(metas[2].positions, ref.capture_meta["hidden_states"][2].positions)
                # Other requests in the batch change the CPU GEMMs' float32 summation order.
                torch.testing.assert_close(tensors[2], ref.captures["hidden_states"][2], rtol=1e-5, atol=1e-5)
        counts[kind] += 1

    async def main() -> None:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            queue = list(plan)
            failures = []

            async def worker() -> None:
                while queue:
                    kind, payload = queue.pop()
                    try:
                        await one(client, kind, payload)
                    except Exception as err:  # collected, so one failure does not hide the others
                        failures.append(f"{kind}: {err!r}")

            await asyncio.gather(*[worker() for _ in range(32)])
            assert not failures, failures[:5]

    asyncio.run(main())
    assert counts == {"good": 800, "bad": 100, "drop": 100}
    assert_nothing_held(http)


