"""What a run's header says about it (commit, card, versions, host, command, arguments) and the
results file its records go to, so that every figure in the docs can be traced to the tree and
the machine that produced it."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys

import torch

from .results import RESULTS_DIR, card_slug

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    """The checkout's commit; ``STEERABLE_COMMIT`` names it where the tree was copied without git."""
    return os.environ.get("STEERABLE_COMMIT") or _git("rev-parse", "--short", "HEAD") or None


def dirty() -> bool | None:
    """Whether tracked files other than the results differ from the commit (None: not known)."""
    if os.environ.get("STEERABLE_COMMIT"):
        return None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return None if status is None else bool(status)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _by_runner() -> bool:
    return bool(sys.argv) and sys.argv[0].endswith(os.path.join("benchmarks", "__main__.py"))


def command() -> str:
    """This process's command line, as typed when the runner started it."""
    if _by_runner():
        return shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]])
    return shlex.join([os.path.basename(sys.executable), *sys.argv])


def prog() -> str | None:
    """``python -m benchmarks NAME`` for the help of a benchmark the runner started."""
    return f"python -m benchmarks {sys.argv[1]}" if _by_runner() and len(sys.argv) > 1 else None


def _gpus() -> tuple[str | None, int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (torch.cuda.get_device_name(0) if count else None), count


# Environment variables that change which kernels the engine runs and how they launch.
TUNING_ENV = ("STEERABLE_ATTENTION_CONFIG", "STEERABLE_ATTENTION_CONFIG_WIDE", "STEERABLE_FINAL_SOFTCAP",
              "STEERABLE_FUSE_POST_NORM", "STEERABLE_PDL", "TORCH_BLAS_PREFER_CUBLASLT")


def tuning_env() -> dict[str, str]:
    """The ``TUNING_ENV`` variables this run has (``benchmarks/probes/gemma2_decode.py`` sets them)."""
    return {k: os.environ[k] for k in TUNING_ENV if k in os.environ}


def describe(args: argparse.Namespace, path: str | None) -> dict:
    """The header's fields: time, commit, card, versions, host, the shape, the command and every argument."""
    import transformers

    gpu, gpus = _gpus()
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "dirty": dirty(), "gpu": gpu, "gpus": gpus, "card": card_slug(gpu, gpus),
            "cpu": _cpu_name(), "host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "transformers": transformers.__version__,
            "python": sys.version.split()[0], "shape": None if args.model else args.shape, "model": path,
            "smoke": args.smoke, "command": command(), "env": tuning_env(), "args": vars(args)}


def results_file(bench: str, args: argparse.Namespace) -> str | None:
    """Where a run's records go besides stdout: ``--out`` (a file, a folder, or ``-`` for nowhere),
    else ``$STEERABLE_BENCH_RESULTS`` or ``benchmarks/results/``; nowhere for ``--smoke`` unless
    ``--out`` says so. A folder gets ``<date>-<card>-<commit>-<bench>.jsonl``, which later runs of
    the same day, card, commit and benchmark append to."""
    target = args.out or (None if args.smoke else os.environ.get("STEERABLE_BENCH_RESULTS", RESULTS_DIR))
    if target is None or target == "-":
        return None
    if not os.path.isdir(target):
        return target
    gpu, gpus = _gpus()
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return os.path.join(target, f"{date}-{card_slug(gpu, gpus)}-{commit() or 'unknown'}-{bench}.jsonl")
