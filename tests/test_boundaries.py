"""The worker boundary (issue 9 §2): the worker, the planes and the ranks of a parallel engine never
import the engine, and the runner and sampler take plain step inputs, not engine objects."""

import ast
import inspect
import pathlib

import steerable
from steerable.step import SamplingInput, StepInput
from steerable.worker.model_runner import ModelRunner
from steerable.worker.sampler import Sampler

PACKAGE = pathlib.Path(steerable.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_worker_and_planes_do_not_import_the_engine():
    offenders = {}
    for package in ("worker", "steering", "capture", "distributed", "executor", "sae"):
        for path in (PACKAGE / package).rglob("*.py"):
            bad = {name for name in _imports(path) if name == "steerable.engine" or name.startswith("steerable.engine.")}
            if bad:
                offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not offenders, offenders


def test_runner_and_sampler_take_plain_inputs():
    launch = inspect.signature(ModelRunner.launch).parameters
    assert [p.annotation for name, p in launch.items() if name != "self"] == ["StepInput"]
    sample = inspect.signature(Sampler.sample).parameters
    assert [p.annotation for name, p in sample.items() if name != "self"] == ["torch.Tensor", "SamplingInput"]
    for cls in (StepInput, SamplingInput):  # only arrays, numbers, strings and plain dataclasses of them
        source = inspect.getsource(inspect.getmodule(cls))
        assert "steerable.engine" not in source and "Request" not in source
