"""Hub ids ("org/name") -> files in the local Hugging Face cache, downloaded only when missing.

The cache is looked at first (``local_files_only=True``), so a cached model loads without any
network, offline or not; only a miss goes online, and only when ``HF_HUB_OFFLINE`` is not set.
Online, the repository's file list decides what to fetch: the config, tokenizer and chat-template
files and the safetensors weights the engine reads (those of the index when there is one), never
pickled weights (``.bin``, ``.pt``) nor other formats; for a GGUF repository only the file asked for.
Every failure is a ``ValueError`` that names the id and what to do, not the hub client's traceback.
huggingface_hub reads ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` itself.
"""

from __future__ import annotations

import json
import os
import sys

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

INDEX_FILE = "model.safetensors.index.json"
# Everything the engine reads besides the weights (transformers' config, tokenizer and chat template).
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "vocab.txt", "chat_template.jinja", "chat_template.json", INDEX_FILE)
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def is_hub_id(model: str) -> bool:
    """Whether ``model`` has the form of a hub repository id, ``org/name`` (bare names are demo names)."""
    if model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_hub_model(repo_id: str, revision: str | None = None, gguf_file: str | None = None) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision`` (the path of ``gguf_file`` in it
    when given), from the cache or, when missing there and online, downloaded into it."""
    cached = _cached(repo_id, revision, gguf_file)
    if cached is not None:
        return cached
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model: {_describe(repo_id, revision)} is not in the Hugging Face cache "
                         f"{constants.HF_HUB_CACHE} (or only in part) and HF_HUB_OFFLINE is set; fetch it first "
                         f"with {_fetch_command(repo_id, revision, gguf_file)}")
    return _download(repo_id, revision, gguf_file)


def _cached(repo_id: str, revision: str | None, gguf_file: str | None) -> str | None:
    """The cached path if the snapshot holds everything the engine reads; None when it does not."""
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True,
                                   allow_patterns=[gguf_file] if gguf_file else list(METADATA_FILES))
    except LocalEntryNotFoundError:  # not cached (or a snapshot the hub knows to be incomplete)
        return None
    if gguf_file:
        path = os.path.join(folder, gguf_file)
        return path if os.path.isfile(path) else None
    names = os.listdir(folder)
    if "config.json" not in names:
        return None
    weights = _index_files(folder) if INDEX_FILE in names else [n for n in names if n.endswith(".safetensors")]
    if not weights:
        _refuse_without_safetensors(repo_id, names)
        return None
    return folder if all(os.path.isfile(os.path.join(folder, w)) for w in weights) else None


def _download(repo_id: str, revision: str | None, gguf_file: str | None) -> str:
    """Fetch what the engine reads into the cache: the metadata first, then the weights the index names."""
    try:
        files = _repo_files(repo_id, revision)
        if gguf_file:
            if gguf_file not in files:
                ggufs = sorted(f for f in files if f.endswith(".gguf"))
                raise ValueError(f"gguf_file: {gguf_file!r} is not in {_describe(repo_id, revision)} "
                                 f"(its GGUF files: {', '.join(ggufs) or 'none'})")
            return os.path.join(snapshot_download(repo_id, revision=revision, allow_patterns=[gguf_file]), gguf_file)
        top = [f for f in files if "/" not in f]
        weights = [f for f in top if f.endswith(".safetensors")]
        if not weights:
            _refuse_without_safetensors(repo_id, top)
            raise ValueError(f"model: {_describe(repo_id, revision)} holds no .safetensors weights")
        metadata = [f for f in METADATA_FILES if f in top]
        folder = snapshot_download(repo_id, revision=revision,
                                   allow_patterns=metadata if INDEX_FILE in top else metadata + weights)
        if INDEX_FILE in top:
            folder = snapshot_download(repo_id, revision=revision, allow_patterns=_index_files(folder))
        return folder
    except GatedRepoError:
        raise ValueError(_gated(repo_id)) from None
    except RevisionNotFoundError:
        raise ValueError(f"revision: {revision!r} is not a branch, tag or commit of {repo_id!r}") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: {repo_id!r} is neither a local directory nor a hub repository that this "
                         f"account can see (a private one needs HF_TOKEN)") from None
    except HfHubHTTPError as err:
        if err.response is not None and err.response.status_code in (401, 403):
            raise ValueError(_gated(repo_id)) from None
        raise ValueError(_unreachable(repo_id, revision, gguf_file, err)) from None
    except _network_errors() as err:
        raise ValueError(_unreachable(repo_id, revision, gguf_file, err)) from None


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """Every file of the repository, from one request with the hub client's metadata timeout
    (``HF_HUB_ETAG_TIMEOUT``, 10 s) and no retries: an unreachable hub fails in that time, not after
    ``list_repo_files``'s five retries with backoff (23 s)."""
    info = HfApi().model_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    return [sibling.rfilename for sibling in info.siblings or []]


def _index_files(folder: str) -> list[str]:
    with open(os.path.join(folder, INDEX_FILE)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _refuse_without_safetensors(repo_id: str, names: list[str]) -> None:
    """Pickled weights can run code when loaded, so a repository holding only those is refused."""
    pickled = sorted(n for n in names if n.endswith(PICKLED_SUFFIXES))
    if pickled:
        raise ValueError(f"model: {repo_id!r} holds only pickled weights ({', '.join(pickled[:3])}), which "
                         f"steerable never loads (unpickling runs code); use a repository or revision with "
                         f".safetensors weights, or convert these to safetensors")
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if ggufs:
        raise ValueError(f"model: {repo_id!r} holds GGUF files; pass gguf_file= (--gguf-file) one of: "
                         f"{', '.join(ggufs)}")


def _network_errors() -> tuple[type[BaseException], ...]:
    """What the hub client raises when the network fails: ``OSError`` (its own errors, requests',
    sockets') and the httpx transport errors of huggingface_hub >= 1.0 (``httpx2`` in 2.x)."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "TransportError"):
            errors.append(module.TransportError)
    return tuple(errors)


def _describe(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" if revision is None else f"{repo_id!r} (revision {revision!r})"


def _fetch_command(repo_id: str, revision: str | None, gguf_file: str | None) -> str:
    args = repo_id + (f" {gguf_file}" if gguf_file else "") + (f" --revision {revision}" if revision else "")
    return f"`huggingface-cli download {args}` (`hf download {args}` with huggingface_hub >= 1.0)"


def _gated(repo_id: str) -> str:
    return (f"model: {repo_id!r} is a gated repository: accept the license at {constants.ENDPOINT}/{repo_id} "
            f"and set HF_TOKEN to a token of that account")


def _unreachable(repo_id: str, revision: str | None, gguf_file: str | None, err: BaseException) -> str:
    return (f"model: {_describe(repo_id, revision)} is not in the Hugging Face cache {constants.HF_HUB_CACHE} "
            f"and the hub could not be reached ({type(err).__name__}: {(str(err).splitlines() or [''])[0]}); "
            f"check the network, or fetch it with {_fetch_command(repo_id, revision, gguf_file)}")
