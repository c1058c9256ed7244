"""Hub ids resolve through the Hugging Face cache, offline, without ever reaching the network.

The cache is written in huggingface_hub's layout (``models--org--name/blobs``, ``snapshots/<commit>``
of links to the blobs, ``refs/<revision>``); the network calls of the online path are replaced by
fakes that raise the hub's own exceptions or record what would be fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from steerable.models import hub
from steerable.models.loader import resolve_model

ROOT = Path(__file__).resolve().parent.parent
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes | Path], commit: str = COMMIT_A,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Write ``files`` (name -> bytes or a file to copy) as snapshot ``commit`` of ``repo_id``,
    content-addressed blobs linked from the snapshot, as huggingface_hub stores a download."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def checkpoint_files(directory: str) -> dict[str, Path]:
    return {p.name: p for p in Path(directory).iterdir() if p.is_file()}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, offline; the network is a failure (nothing here may reach it)."""
    root = tmp_path / "hub-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("the network was called")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", no_network)
    return root


@pytest.fixture
def online(cache, monkeypatch):
    """Online mode: ``model_info`` lists ``online.files`` (or raises ``online.error``);
    ``snapshot_download`` online writes the files it is asked for into the cache and records them."""
    state = SimpleNamespace(files=[], content={}, error=None, fetched=[])
    real = hub.snapshot_download
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def model_info(self, repo_id, revision=None, **kwargs):
        if state.error is not None:
            raise state.error
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=name) for name in state.files])

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False, **kwargs):
        if local_files_only:
            return real(repo_id, revision=revision, allow_patterns=allow_patterns, local_files_only=True)
        state.fetched.extend(allow_patterns)
        return str(put_in_cache(cache, repo_id, {n: state.content[n] for n in allow_patterns}))
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    return state


def test_cached_model_loads_offline_and_generates_as_its_directory(cache, model_dirs):
    from steerable import LLM, SamplingParams

    snapshot = put_in_cache(cache, "org/tiny", checkpoint_files(model_dirs["llama"]))
    assert resolve_model("org/tiny").path == str(snapshot)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for name in ("org/tiny", model_dirs["llama"]):
        with LLM(name, device="cpu", kv_cache_tokens=512) as llm:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(["Hello world", "Steering"], params,
                                                                      use_tqdm=False)]
    assert outs["org/tiny"] == outs[model_dirs["llama"]]
    assert len(set(map(tuple, outs["org/tiny"]))) == 2  # two prompts, two continuations: not a constant


def test_cli_takes_a_hub_id(cache, model_dirs, capsys):
    from steerable.entrypoints.cli import main

    put_in_cache(cache, "org/tiny", checkpoint_files(model_dirs["llama"]))
    flags = ["--device", "cpu", "--kv-cache-tokens", "256", "--raw", "--prompt", "Hello world", "--max-tokens", "4"]
    assert main(["generate", "--model", "org/tiny", *flags]) == 0
    hub_out = capsys.readouterr().out
    assert main(["generate", "--model", model_dirs["llama"], *flags]) == 0
    assert capsys.readouterr().out == hub_out and hub_out.startswith(">>> Hello world\n")
    assert main(["generate", "--model", "org/missing", *flags]) == 2
    err = capsys.readouterr().err
    assert "huggingface-cli download org/missing" in err and "Traceback" not in err


def test_revision_picks_its_snapshot(cache):
    files = {"config.json": b"{}", "model.safetensors": b"x"}
    main = put_in_cache(cache, "org/tiny", files, COMMIT_A, refs=("main",))
    tagged = put_in_cache(cache, "org/tiny", {**files, "model.safetensors": b"y"}, COMMIT_B, refs=("v2",))
    assert resolve_model("org/tiny").path == str(main)
    assert resolve_model("org/tiny", revision="v2").path == str(tagged)
    assert resolve_model("org/tiny", revision=COMMIT_B).path == str(tagged)  # a commit needs no ref
    with pytest.raises(ValueError, match=r"'org/tiny' \(revision 'v3'\).*not in the Hugging Face cache"):
        resolve_model("org/tiny", revision="v3")


def test_missing_model_fails_fast_offline_naming_id_cache_and_fetch(cache):
    with pytest.raises(ValueError) as err:
        resolve_model("org/missing")
    message = str(err.value)
    assert "'org/missing'" in message and str(cache) in message
    assert "huggingface-cli download org/missing" in message and "HF_HUB_OFFLINE" in message


def test_partial_snapshot_counts_as_missing(cache):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    put_in_cache(cache, "org/part", {"config.json": b"{}", hub.INDEX_FILE: json.dumps(index).encode(),
                                     "model-00001-of-00002.safetensors": b"x"})
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model("org/part")


def test_pickled_only_repository_is_refused(cache):
    put_in_cache(cache, "org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04"})
    with pytest.raises(ValueError, match=r"only pickled weights \(pytorch_model.bin\).*never loads"):
        resolve_model("org/pickled")


def test_gguf_file_of_a_cached_repository(cache):
    snapshot = put_in_cache(cache, "org/quants", {"model-Q4_K_M.gguf": b"GGUF", "model-Q8_0.gguf": b"GGUF"})
    source = resolve_model("org/quants", gguf_file="model-Q4_K_M.gguf")
    assert source.gguf_file == str(snapshot / "model-Q4_K_M.gguf") and source.directory == str(snapshot)
    with pytest.raises(ValueError, match=r"huggingface-cli download org/quants model-Q2_K.gguf"):
        resolve_model("org/quants", gguf_file="model-Q2_K.gguf")


def test_local_paths_and_demo_names_win_and_reject_hub_arguments(cache, model_dirs, tmp_path, monkeypatch):
    put_in_cache(cache, "org/tiny", {"config.json": b"{}", "model.safetensors": b"x"})
    monkeypatch.chdir(tmp_path)
    shutil.copytree(model_dirs["llama"], "org/tiny")
    assert resolve_model("org/tiny").path == "org/tiny"  # the relative directory, not the cached snapshot
    with pytest.raises(ValueError, match="revision: applies to hub ids"):
        resolve_model("org/tiny", revision="main")
    with pytest.raises(ValueError, match="gguf_file: 'x.gguf' is not a file in 'org/tiny'"):
        resolve_model("org/tiny", gguf_file="x.gguf")
    with pytest.raises(ValueError, match="gguf_file: applies to a hub id or a directory"):
        resolve_model("smollm2", gguf_file="x.gguf")
    with pytest.raises(ValueError, match="neither a directory, a .gguf file, a hub id"):
        resolve_model("not-a-demo")


def test_online_fetches_only_what_the_engine_reads(online):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    online.content = {"config.json": b"{}", "tokenizer.json": b"{}", "generation_config.json": b"{}",
                      hub.INDEX_FILE: json.dumps(index).encode(), "model-00001-of-00002.safetensors": b"1",
                      "model-00002-of-00002.safetensors": b"2"}
    online.files = [*online.content, "consolidated.safetensors", "pytorch_model.bin", "onnx/model.onnx",
                    "original/consolidated.00.pth", "flax_model.msgpack", "tf_model.h5", "README.md"]
    folder = resolve_model("org/big").path
    assert sorted(online.fetched) == sorted(online.content)
    assert sorted(os.listdir(folder)) == sorted(online.content)
    online.fetched.clear()
    assert resolve_model("org/big").path == folder and online.fetched == []  # cached now: no second fetch


def test_online_refuses_pickled_only_and_lists_ggufs(online):
    online.files = ["config.json", "pytorch_model.bin", "README.md"]
    with pytest.raises(ValueError, match="only pickled weights"):
        resolve_model("org/old")
    online.files = ["README.md", "m-Q4_K_M.gguf"]
    with pytest.raises(ValueError, match="pass gguf_file= .*m-Q4_K_M.gguf"):
        resolve_model("org/quants")
    with pytest.raises(ValueError, match=r"gguf_file: 'm-Q8_0.gguf' is not in 'org/quants' \(its GGUF files: m-Q4"):
        resolve_model("org/quants", gguf_file="m-Q8_0.gguf")
    assert online.fetched == []


def _http_error(cls, status: int, message: str):
    response = MagicMock(status_code=status, headers={})
    return cls(message, response=response)


@pytest.mark.parametrize("error, expected", [
    (_http_error(GatedRepoError, 403, "Cannot access gated repo"), "gated repository: accept the license.*HF_TOKEN"),
    (_http_error(HfHubHTTPError, 401, "Unauthorized"), "accept the license.*HF_TOKEN"),
    (_http_error(RepositoryNotFoundError, 404, "Repository Not Found"), "neither a local directory nor a hub"),
    (_http_error(RevisionNotFoundError, 404, "Revision Not Found"), "revision: 'v9' is not a branch"),
    (_http_error(HfHubHTTPError, 503, "Service Unavailable"), "could not be reached.*huggingface-cli download"),
    (ConnectionError("Name or service not known"), "could not be reached.*huggingface-cli download"),
], ids=["gated", "401", "not-found", "revision", "503", "no-network"])
def test_online_errors_name_the_cause(online, error, expected):
    online.error = error
    with pytest.raises(ValueError, match=expected) as err:
        resolve_model("org/gated", revision="v9")
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no hub-client traceback


def test_cli_flags_reach_the_engine_arguments():
    from steerable.entrypoints.cli import build_parser
    from steerable.entrypoints.cli.common import engine_kwargs

    args = build_parser().parse_args(["serve", "org/quants", "--revision", "v2", "--gguf-file", "m-Q4_K_M.gguf"])
    kwargs = engine_kwargs(args)
    assert (kwargs["model"], kwargs["revision"], kwargs["gguf_file"]) == ("org/quants", "v2", "m-Q4_K_M.gguf")
    args = build_parser().parse_args(["generate", "--model", "org/tiny", "--gguf-file", "weights.bin"])
    with pytest.raises(Exception, match="gguf_file must name a .gguf file"):
        engine_kwargs(args)


def test_environment_variables_choose_cache_and_offline_mode(tmp_path):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, read by huggingface_hub at import."""
    snapshot = put_in_cache(tmp_path / "home" / "hub", "org/tiny", {"config.json": b"{}", "model.safetensors": b"x"})
    # hub.py alone (it imports only huggingface_hub), not the steerable package: a second of start-up.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('hub', sys.argv[1]);\n"
            "hub = importlib.util.module_from_spec(spec); spec.loader.exec_module(hub); print(hub.resolve_hub_model('org/tiny'))\n"
            "try: hub.resolve_hub_model('org/missing')\nexcept ValueError as e: print(e)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "steerable" / "models" / "hub.py")], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out[0] == str(snapshot)
    assert str(tmp_path / "home" / "hub") in out[1] and "HF_HUB_OFFLINE is set" in out[1]


def _resolve_in_subprocess(tmp_path, **env_vars) -> tuple[float, str, str]:
    """``resolve_hub_model('org/missing')`` in a fresh process with the hub's environment
    variables as a user sets them: (seconds the call took, its error, the process's stderr)."""
    code = ("import importlib.util, sys, time; spec = importlib.util.spec_from_file_location('hub', sys.argv[1]);\n"
            "hub = importlib.util.module_from_spec(spec); spec.loader.exec_module(hub); start = time.monotonic()\n"
            "try: hub.resolve_hub_model('org/missing')\nexcept ValueError as e: print(time.monotonic() - start); print(e)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "home"), **env_vars)
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "steerable" / "models" / "hub.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    seconds, message = proc.stdout.splitlines()[:2]
    return float(seconds), message, proc.stderr


def test_an_unreachable_hub_fails_at_once_without_retries(tmp_path):
    """A hub id neither cached nor fetchable: a refused connection fails in one attempt (the hub
    client's file listing retried five times with backoff, 23 s); a hub that never answers within
    HF_HUB_ETAG_TIMEOUT; and with HF_HUB_OFFLINE set nothing is tried at all."""
    import select
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    seconds, message, stderr = _resolve_in_subprocess(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{closed}")
    assert seconds < 3 and "could not be reached" in message and "Connection refused" in message
    assert "Retrying" not in stderr

    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        seconds, message, _ = _resolve_in_subprocess(tmp_path, HF_ENDPOINT=endpoint, HF_HUB_ETAG_TIMEOUT="1")
        assert 1 <= seconds < 5 and "could not be reached" in message and "Timeout" in message
        while select.select([silent], [], [], 0)[0]:  # the connections of the attempt above
            silent.accept()[0].close()
        seconds, message, _ = _resolve_in_subprocess(tmp_path, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="1")
        assert "HF_HUB_OFFLINE is set" in message and seconds < 1
        assert not select.select([silent], [], [], 0)[0], "offline, the hub was contacted"
