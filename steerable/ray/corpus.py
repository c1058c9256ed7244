"""``ray=ADDRESS`` (``--ray``): corpus capture on a Ray cluster. ``local`` starts a cluster on this
machine (or uses the one this process is connected to), ``auto`` joins the running one, anything
else is its address (``host:port`` or ``ray://host:port``).

One engine actor per GPU (``num_gpus=1``, or ``tensor_parallel_size`` GPUs), or ``replicas``
actors; each shard is one call on an actor, which captures it with the loop a single engine runs
(``corpus_run.capture_shards``) and writes it under a temporary name in the output directory (a
path every node shares, or an fsspec URL); this process, the driver, commits it. Actors restart and
retry their call when their process dies (Ray's ``max_restarts`` / ``max_task_retries``); once an
actor is gone for good its shard goes to another. The output is the same as one engine's.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from typing import Any

from steerable.capture.corpus_run import ShardSpec, capture_shards
from steerable.capture.shard_stores import Commit, ShardTask
from steerable.errors import InvalidRequestError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # Ray itself retries an unreachable cluster for minutes
RESTARTS = 2  # per actor, each retrying the call it was running
CALLS_AHEAD = 2  # calls queued on an actor, so its engine starts the next shard at once


def check_ray(address: Any) -> str:
    """``address`` if Ray is installed and a cluster answers there (``local`` needs none):
    ``InvalidRequestError`` within seconds otherwise."""
    try:
        import ray
    except ImportError:
        raise InvalidRequestError("ray: Ray is not installed; pip install 'steerable[ray]'") from None
    if not isinstance(address, str) or not address:
        raise InvalidRequestError(f"ray: expected 'local', 'auto' or a cluster address, got {address!r}")
    if address == "local" or (address == "auto" and ray.is_initialized()):
        return address
    target = address
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            target = canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError as err:
            raise InvalidRequestError(f"ray: no running Ray cluster found for 'auto' ({err}); start one with "
                                      "`ray start --head` or pass --ray local") from None
        except ImportError:  # Ray moved its helper: let ray.init find the cluster
            return address
    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as err:
        raise InvalidRequestError(f"ray: cannot reach a Ray cluster at {address!r} ({err}); start one with "
                                  "`ray start --head` or check the address") from None
    return address


class EngineActor:
    """One engine, reused for every shard it is handed."""

    def __init__(self, engine_config: dict[str, Any], sae: tuple[str, Any] | None, spec: ShardSpec):
        from steerable.entrypoints.llm import LLM

        self.llm = LLM(**engine_config)
        if sae is not None:
            self.llm.register_sae(*sae)
        self.spec = spec

    def capture(self, task: ShardTask) -> tuple[dict[str, Any], str]:
        """Capture one shard; returns its index entry and its staged file's name."""
        done: list[tuple[dict[str, Any], str]] = []
        capture_shards(self.llm.llm_engine, self.spec, iter([task]), lambda entry, part: done.append((entry, part)))
        return done[0]


def _actor_count(ray: Any, engine_config: dict[str, Any], replicas: int) -> tuple[int, int]:
    """(actors, GPUs per actor): ``replicas`` if asked for, else one per GPU group of the cluster."""
    per = engine_config.get("tensor_parallel_size", 1) * engine_config.get("pipeline_parallel_size", 1)
    gpus = int(ray.cluster_resources().get("GPU", 0)) if engine_config.get("device", "auto") != "cpu" else 0
    if gpus:
        count = replicas if replicas > 1 else max(1, gpus // per)
        if count * per > gpus:
            raise InvalidRequestError(f"replicas: {count} engines of {per} GPU(s) need {count * per} GPUs; the "
                                      f"cluster has {gpus}")
        return count, per
    return replicas, 0


def capture_on_ray(address: str, plan: Any, todo: list[int], engine_config: dict[str, Any],
                   sae: tuple[str, Any] | None, replicas: int, commit: Commit) -> dict[str, Any]:
    import ray
    from ray.exceptions import RayActorError

    started_here = not ray.is_initialized()  # else: the cluster this process is connected to
    if started_here:
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    stats = {"actors": 0, "actors_lost": 0, "shards_redone": 0}
    actors: list[Any] = []
    try:
        count, gpus = _actor_count(ray, engine_config, replicas)
        config = dict(engine_config)
        cpus = 1
        if not gpus:
            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // count)
            config.setdefault("cpu_threads", None)
            config["cpu_threads"] = config["cpu_threads"] or cpus
        actor_cls = ray.remote(EngineActor).options(num_gpus=gpus, num_cpus=cpus, max_restarts=RESTARTS,
                                                    max_task_retries=RESTARTS)
        actors = [actor_cls.remote(config, sae, plan.spec) for _ in range(count)]
        stats["actors"] = count
        pending = deque(todo)
        calls: dict[Any, tuple[Any, int]] = {}  # call -> (actor, shard)

        def hand(actor: Any) -> None:
            k = pending.popleft()
            calls[actor.capture.remote(plan.task(k))] = (actor, k)

        for actor in actors:
            for _ in range(CALLS_AHEAD):
                if pending:
                    hand(actor)
        while calls:
            (ready,), _ = ray.wait(list(calls), num_returns=1)
            actor, k = calls.pop(ready)
            try:
                entry, part = ray.get(ready)
            except RayActorError as err:  # gone for good after its restarts: its shards go elsewhere
                logger.warning("capture_corpus: a Ray engine actor died for good (%s); shard %d is redone", err, k)
                actors = [a for a in actors if a is not actor]
                lost = [key for key, (a, _) in calls.items() if a is actor]
                redo = sorted([k, *(calls.pop(key)[1] for key in lost)], reverse=True)
                pending.extendleft(redo)
                stats["actors_lost"] += 1
                stats["shards_redone"] += len(redo)
                if not actors:
                    raise RuntimeError("capture_corpus: every Ray engine actor died; the shards committed so far are "
                                       "kept: run again with --resume") from err
                for survivor in actors:
                    while pending and sum(a is survivor for a, _ in calls.values()) < CALLS_AHEAD:
                        hand(survivor)
                continue
            commit(entry, part)
            if pending:
                hand(actor)
    finally:
        for actor in actors:
            ray.kill(actor)  # its engine's memory, and no file written after the parts are removed
        if started_here:
            ray.shutdown()
        plan.run_dir.remove_parts()
    return stats
