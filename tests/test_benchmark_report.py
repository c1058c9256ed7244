"""The benchmarks' runner and report without running a benchmark: ``--list``, the results store's
format, the report's choice of records, and docs/benchmarks.md's tables equal to what
``python -m benchmarks report`` makes of the committed records."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
from argparse import Namespace

import pytest

from benchmarks import BENCHMARKS, PROBES, module_name, provenance, report, results
from benchmarks.results import Run
from benchmarks.tables import TABLES, Figure, Table, at_most

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package's own modules: everything else in benchmarks/ is a benchmark and must be registered.
INFRASTRUCTURE = {"__init__", "__main__", "common", "provenance", "results", "report", "tables",
                  "topk_trainer",  # activation_stream's trainer, not a benchmark of its own
                  "duel_peer"}  # cpu_duel's other engine, a process of its own


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def _source(name: str) -> str:
    with open(os.path.join(ROOT, *module_name(name).split(".")) + ".py") as f:
        return f.read()


def test_list_names_every_benchmark_and_probe_on_one_line():
    out = runner("--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in BENCHMARKS + PROBES:
        (line,) = [line for line in lines if line.split(" ", 1)[0] == name]
        assert len(line.split(None, 1)[1]) > 20  # the docstring's first line
    assert lines.index("probes (one question each; benchmarks/probes/):") > len(BENCHMARKS) - 1


def test_every_module_is_registered_with_main_argv_and_a_summary_line():
    found = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py")} - INFRASTRUCTURE
    probes = {f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks", "probes")) if f.endswith(".py")} - {"__init__"}
    assert found == set(BENCHMARKS) and probes == set(PROBES)
    for name in BENCHMARKS + PROBES:
        tree = ast.parse(_source(name))
        summary, *rest = ast.get_docstring(tree).splitlines()
        assert 20 < len(summary) <= 110 and (not rest or not rest[0].strip()), name  # one line, then a blank
        (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert [a.arg for a in main.args.args] == ["argv"], name
    with pytest.raises(ValueError, match="--list"):
        module_name("no_such_benchmark")


def test_every_benchmark_is_smoke_run_through_the_runner():
    texts = [p.read_text() for p in pathlib.Path(ROOT, "tests").glob("test_*.py")]
    smoked = {name for text in texts if "from bench_harness import" in text
              for name in re.findall(r'\brun\("(\w+)"', text)}
    assert set(BENCHMARKS) <= smoked <= set(BENCHMARKS + PROBES)


def test_unknown_benchmark_exits_2_naming_the_list():
    out = runner("no_such_benchmark")
    assert out.returncode == 2 and "--list" in out.stderr


def test_docs_tables_equal_the_report_of_the_committed_records():
    out = runner("report", "--check")
    assert out.returncode == 0, "docs/benchmarks.md is stale; run `python -m benchmarks report`:\n" + out.stdout


def test_committed_results_are_runs_with_full_headers():
    runs = results.load()
    assert runs
    for run in runs:
        header = run.header
        for key in ("time", "commit", "gpu", "gpus", "card", "torch", "triton", "python", "shape", "args"):
            assert key in header, (run.file, key)
        assert run.file.startswith(f"{header['time'][:10]}-{header['card']}-"), run.file
        assert run.file.endswith(f"-{header['bench']}.jsonl") and not header.get("smoke"), run.file
        assert all(record["bench"] == run.bench for _, record in run.records)


def test_every_table_shows_a_record_or_says_there_is_none():
    runs = results.load()
    for table in TABLES:
        for line in report.render(table, runs).splitlines()[2:]:
            assert "no record yet" in line or re.search(r"\]\(\.\./benchmarks/results/[\w.-]+\.jsonl#L\d+\)", line)


# ---------------------------------------------------------------- the store and the report on made-up runs

def _header(time: str, gpu: str | None = "NVIDIA H200", gpus: int = 1, commit: str = "abc1234", **more) -> dict:
    return {"bench": "throughput", "record": "header", "time": time, "commit": commit, "gpu": gpu, "gpus": gpus,
            "card": results.card_slug(gpu, gpus), "shape": "qwen3-0.6b", "smoke": False,
            "args": {"repeats": 3}, **more}


def _run(file: str, header: dict, *records: dict) -> Run:
    lines = [json.dumps(header)] + [json.dumps({"bench": "throughput", **r}) for r in records]
    (run,) = results.parse(file, lines)
    return run


FIGURE = Figure("dense", "throughput", "steerable", "output_tok_s", lambda v: f"{v:.0f}", {"shape": "qwen3-0.6b"},
                goal=at_most(150, "≤ 150"))


def test_parse_names_the_line_of_a_record_without_its_header():
    header = json.dumps(_header("2026-01-01T00:00:00+00:00"))
    with pytest.raises(ValueError, match="f.jsonl:1: a 'throughput' record without"):
        results.parse("f.jsonl", [json.dumps({"bench": "throughput", "record": "steerable"})])
    with pytest.raises(ValueError, match="f.jsonl:2: not JSON"):
        results.parse("f.jsonl", [header, "{"])
    with pytest.raises(ValueError, match="f.jsonl:2: a 'latency' record without"):
        results.parse("f.jsonl", [header, json.dumps({"bench": "latency", "record": "latency"})])


def test_report_takes_the_newest_matching_record_of_each_card():
    old = _run("a.jsonl", _header("2026-01-01T00:00:00+00:00"), {"record": "steerable", "output_tok_s": 100.0})
    new = _run("b.jsonl", _header("2026-01-02T00:00:00+00:00", commit="def5678", dirty=True),
               {"record": "steerable", "output_tok_s": 120.0}, {"record": "steerable", "output_tok_s": 200.0})
    other_shape = _run("c.jsonl", _header("2026-01-03T00:00:00+00:00", shape="gpt2"),
                       {"record": "steerable", "output_tok_s": 999.0})
    smoke = _run("d.jsonl", _header("2026-01-04T00:00:00+00:00", smoke=True), {"record": "steerable", "output_tok_s": 5.0})
    h100 = _run("e.jsonl", _header("2025-12-01T00:00:00+00:00", gpu="NVIDIA H100 80GB HBM3"),
                {"record": "steerable", "output_tok_s": 90.0})
    tuned = _run("f.jsonl", _header("2026-01-05T00:00:00+00:00", env={"STEERABLE_FUSE_POST_NORM": "0"}),
                 {"record": "steerable", "output_tok_s": 7.0})  # a tuning run is not the defaults' figure
    found = report.newest(FIGURE, [old, new, other_shape, smoke, h100, tuned])
    assert [(f.run.card, f.record["output_tok_s"], f.line) for f in found] == [("H100 80GB HBM3", 90.0, 2),
                                                                              ("H200", 200.0, 3)]
    table = report.render(Table("t", (FIGURE,)), [old, new, h100]).splitlines()
    assert table[0] == "| figure | value | goal | met | card | commit | record |"
    assert table[2] == "| dense | 90 | ≤ 150 | yes | H100 80GB HBM3 | abc1234 | [e.jsonl:2](../benchmarks/results/e.jsonl#L2) |"
    assert table[3] == ("| dense | 200 | ≤ 150 | **no** | H200 | def5678 (uncommitted changes) | "
                        "[b.jsonl:3](../benchmarks/results/b.jsonl#L3) |")
    only_h200 = dataclasses.replace(FIGURE, card="H200")
    assert [f.run.card for f in report.newest(only_h200, [old, new, h100])] == ["H200"]
    assert report.render(Table("t", (FIGURE,)), [smoke]).splitlines()[2] == "| dense | no record yet | ≤ 150 | — |  |  |  |"


def test_update_rewrites_only_the_blocks_and_knows_every_table():
    run = _run("a.jsonl", _header("2026-01-01T00:00:00+00:00"), {"record": "steerable", "output_tok_s": 100.0})
    tables = (Table("dense", (FIGURE,)),)
    text = "intro\n<!-- report: dense -->\nstale\n<!-- /report -->\nafter\n"
    new = report.update(text, tables, [run])
    assert new == f"intro\n<!-- report: dense -->\n{report.render(tables[0], [run])}<!-- /report -->\nafter\n"
    assert report.update(new, tables, [run]) == new
    with pytest.raises(ValueError, match="names no table"):
        report.update(text + "<!-- report: other -->\n<!-- /report -->\n", tables, [run])
    with pytest.raises(ValueError, match=r"without a .* block"):
        report.update("no blocks\n", tables, [run])


def test_card_names():
    assert results.card_slug("NVIDIA H200", 1) == "h200" and results.card_slug("NVIDIA H200", 2) == "h200x2"
    assert results.card_slug("NVIDIA H100 80GB HBM3", 1) == "h100" and results.card_slug(None, 0) == "cpu"
    assert results.card_label({"gpu": "NVIDIA H200", "gpus": 2}) == "2× H200"
    assert results.card_label({"gpu": None, "gpus": 0}) == "CPU"
    assert results.card_label({"gpu": None, "gpus": 0, "cpu": "Intel(R) Xeon(R) Processor"}) == "CPU (Intel Xeon)"


def test_results_file(tmp_path, monkeypatch):
    """A run's records go to the store unless it is a smoke run; ``--out`` names a file, a folder or
    nothing, ``$STEERABLE_BENCH_RESULTS`` another store."""
    monkeypatch.delenv("STEERABLE_BENCH_RESULTS", raising=False)
    monkeypatch.setenv("STEERABLE_COMMIT", "abc1234")
    default = provenance.results_file("throughput", Namespace(out=None, smoke=False))
    assert os.path.dirname(default) == results.RESULTS_DIR
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-cpu-abc1234-throughput\.jsonl", os.path.basename(default))
    assert provenance.results_file("throughput", Namespace(out=None, smoke=True)) is None
    assert provenance.results_file("throughput", Namespace(out="-", smoke=False)) is None
    assert provenance.results_file("throughput", Namespace(out=str(tmp_path / "x.jsonl"), smoke=True)) == \
        str(tmp_path / "x.jsonl")
    monkeypatch.setenv("STEERABLE_BENCH_RESULTS", str(tmp_path))
    assert provenance.results_file("latency", Namespace(out=None, smoke=False)).startswith(str(tmp_path))
