"""``cpu_duel``: the smoke duel (steerable against a second steerable engine behind the peer
protocol) keeps its records and its ABBA order, its ratio is the runs' medians, and a token that
differs between the engines, or a peer that dies, stops the run."""

from __future__ import annotations

import statistics
import sys

import pytest
from bench_harness import run

from benchmarks import cpu_duel


@pytest.mark.slow
def test_smoke_duel_records(tmp_path):
    r = run("cpu_duel", str(tmp_path), "--repeats", "3", model=False)
    assert r["peer"][0]["engine"] == "steerable_peer" and r["peer"][0]["settings"]["cpu_threads"] == 1
    assert r["llm_init"][0]["cpu_threads"] == 1 and r["llm_init"][0]["enable_prefix_caching"] is False
    ratios = {x["workload"]: x for x in r["ratio"]}
    assert set(ratios) == {"batch64", "batch1"}
    for workload, ratio in ratios.items():
        runs = [x for x in r["run"] if x["workload"] == workload]
        # ABBA: round 0 starts with steerable, round 1 with the peer, round 2 with steerable again
        assert [x["engine"] for x in runs] == ["steerable", "steerable_peer", "steerable_peer", "steerable",
                                               "steerable", "steerable_peer"]
        ours = [x["seconds"] for x in runs if x["engine"] == "steerable"]
        theirs = [x["seconds"] for x in runs if x["engine"] == "steerable_peer"]
        assert ratio["steerable_over_vllm"] == pytest.approx(statistics.median(theirs) / statistics.median(ours))
        assert ratio["tokens_identical"] is True and ratio["repeats"] == 3
        for x in runs:
            assert x["output_tokens"] == x["requests"] * 8 and x["output_tok_s"] == pytest.approx(8 * x["requests"]
                                                                                                  / x["seconds"])
    assert ratios["batch64"]["steerable_output_tok_s"] > 0
    assert [x["requests"] for x in r["run"][:1]] == [4]
    one = [x for x in r["run"] if x["workload"] == "batch1"]
    assert all(x["requests"] == 1 and x["ms_per_token"] == pytest.approx(x["seconds"] * 1e3 / 8) for x in one)
    assert ratios["batch1"]["steerable_ms_per_token"] > 0 and ratios["batch1"]["vllm_ms_per_token"] > 0


def test_differing_tokens_stop_the_duel():
    same = [[1, 2, 3], [4, 5, 6]]
    cpu_duel.check_same("batch64", same, [list(x) for x in same])
    with pytest.raises(SystemExit, match="prompt 1 differs at token 2"):
        cpu_duel.check_same("batch64", same, [[1, 2, 3], [4, 5, 7]])
    with pytest.raises(SystemExit, match="prompt 0 differs at token 3"):  # the peer stopped early
        cpu_duel.check_same("batch1", [[1, 2, 3, 4]], [[1, 2, 3]])
    with pytest.raises(SystemExit, match="2 outputs against the peer's 1"):
        cpu_duel.check_same("batch64", same, same[:1])


def test_a_peer_that_dies_stops_the_duel(tmp_path):
    with pytest.raises(SystemExit, match="the peer exited"):
        cpu_duel.Peer(sys.executable, "steerable", str(tmp_path / "no-model"), 0)


def test_workloads_are_seeded_and_sized():
    full = {d.name: d for d in cpu_duel.workloads(49152, 0, smoke=False)}
    assert len(full["batch64"].prompts) == 64 and full["batch64"].max_tokens == 64
    assert all(16 <= len(p) <= 128 for p in full["batch64"].prompts)
    assert [len(p) for p in full["batch1"].prompts] == [128] and full["batch1"].max_tokens == 64
    assert full["batch64_prefill"].prompts == full["batch64"].prompts and full["batch64_prefill"].max_tokens == 1
    assert all(0 <= t < 49152 for p in full["batch64"].prompts for t in p)
    again = {d.name: d for d in cpu_duel.workloads(49152, 0, smoke=False)}
    assert again["batch64"].prompts == full["batch64"].prompts
