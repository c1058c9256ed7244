"""steerable's benchmarks, run through one runner::

    python -m benchmarks --list                 # the maintained benchmarks and the probes, one line each
    python -m benchmarks NAME [ARGS...]         # e.g. throughput --shape gemma2-2b --repeats 3
    python -m benchmarks NAME --smoke           # a tiny model on a CPU in seconds (the tests do this)
    python -m benchmarks report [--check]       # docs/benchmarks.md's tables, from benchmarks/results/

A benchmark is a module of this package with a first docstring line that says what it measures
and ``main(argv: list[str] | None = None)``, which parses ``argv`` with ``common.parser`` (the
shared flags: ``--shape``, ``--smoke``, ``--out``...) and calls ``common.setup(NAME, args, ...)``
before it emits anything. It runs its baseline in the same process and prints one JSON line per
figure through ``common.emit``: ``{"bench": NAME, "record": KIND, ...}``. ``common.setup`` prints
the run's header (commit, card, versions, arguments) first and, unless ``--smoke``, appends every
line to ``benchmarks/results/<date>-<card>-<commit>-<NAME>.jsonl`` (``--out`` or
``$STEERABLE_BENCH_RESULTS`` name another file or folder).

Adding one:

1. write ``benchmarks/NAME.py`` as above (its ``--smoke`` must run on a CPU in seconds);
2. add ``"NAME"`` to ``BENCHMARKS`` below (one line);
3. add a smoke test to ``tests/test_benchmarks.py`` (``run("NAME", bench_cache_dir, ...)`` from
   ``tests/bench_harness.py``; a plane's benchmark goes to ``test_benchmarks_planes.py``);
4. for a figure the docs should show, add a ``Figure`` to ``benchmarks/tables.py``, commit the
   run's records and run ``python -m benchmarks report``.

A probe answers one question once (a kernel sweep, a profile, a table generator) and lives in
``benchmarks/probes/``, registered in ``PROBES``; its first docstring line is the question. When
the question is answered, the answer goes into docs/benchmarks.md and the probe is deleted.
"""

# Maintained benchmarks: one name a line, each a module of this package.
BENCHMARKS = (
    "throughput",
    "latency",
    "serve",
    "steering_cost",
    "capture_cost",
    "sae_cost",
    "dashboards",
    "pattern_cost",
    "capture_corpus",
    "saelens_cache",
    "corpus_shards",
    "corpus_host",
    "cold_start",
    "parallel",
    "chat",
    "kv_memory",
    "kv_fidelity",
    "output_codec",
    "host_step_cost",
    "activation_stream",
    "neuronpedia",
    "cpu_duel",
)

# Probes still in use: modules of ``benchmarks.probes``.
PROBES = (
    "attention_replay",
    "dashboards_chunks",
    "gemma2_decode",
    "moe_tune",
    "profile_kernels",
    "saelens_split",
)


def module_name(name: str) -> str:
    """The module that runs benchmark or probe ``name``; ``ValueError`` for an unknown one."""
    if name in BENCHMARKS:
        return f"{__name__}.{name}"
    if name in PROBES:
        return f"{__name__}.probes.{name}"
    raise ValueError(f"unknown benchmark {name!r}: see `python -m benchmarks --list`")
