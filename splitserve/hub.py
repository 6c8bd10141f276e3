"""Where a model's files are: a local directory, or a Hugging Face hub id resolved to a snapshot.

`resolve_model` resolves the way vLLM and transformers do, through `huggingface_hub`: the hub
cache (`HF_HOME`, `HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (the cache only, no network), a revision
(branch, tag or commit; default `main`). Every process that needs the files resolves the same
snapshot directory: workers are handed that directory and serve it under the hub id, so the
router's tokenizer (the workers' model root) and the connector's model check read the files the
engines load.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
from dataclasses import dataclass
from pathlib import Path

# Weight formats, most preferred first (vLLM's own order): a download takes the first the
# repository has and skips the others.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
# Never needed to serve: other frameworks' weights and the original (non-HF) checkpoints.
ALWAYS_IGNORED = ("original/*", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf", "*.pth")


@dataclass(frozen=True)
class ModelSource:
    """A model's local directory and the name it is served under: the hub id it was resolved
    from, as vLLM serves a hub id (None: served under its directory, vLLM's default); and, for a
    hub id, the commit that directory holds (the hub cache's `snapshots/<commit>`), which
    names those same files wherever they are resolved again."""

    path: str
    name: str | None = None
    revision: str | None = None


def looks_like_path(model: str) -> bool:
    """A name meant as a directory (absolute, relative with `.`/`~`, or more than org/name)."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or Path(model).exists()


def check_model_name(model: str, revision: str | None = None) -> None:
    """Raise ValueError unless `model` is an existing directory or a well-formed hub id; a
    revision only goes with a hub id. Resolves nothing (no cache or network access)."""
    if Path(model).is_dir():
        if revision is not None:
            raise ValueError(f"--revision applies to a Hugging Face model id; {model!r} is a "
                             "directory")
        return
    if looks_like_path(model):
        raise ValueError(f"model directory {model!r} does not exist: give the directory of a "
                         "Hugging Face checkpoint (with its config.json), or a hub model id "
                         "such as Qwen/Qwen3-0.6B")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        raise ValueError(f"model {model!r} is neither a directory nor a Hugging Face model id "
                         f"({exc})") from None


def check_model_dir(path: str) -> None:
    """Raise ValueError unless the directory `path` holds a checkpoint's config.json (what vLLM
    reads first; without it, vLLM fails with a long traceback)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model directory {path!r} has no config.json: give the directory of "
                         "a Hugging Face checkpoint (config.json, tokenizer, weights)")


def download_ignore_patterns(repo_files: list[str]) -> list[str]:
    """What a download skips: every weight format but the first the repository holds."""
    for i, pattern in enumerate(WEIGHT_PATTERNS):
        if fnmatch.filter(repo_files, pattern):
            return [*ALWAYS_IGNORED, *WEIGHT_PATTERNS[i + 1:]]
    return list(ALWAYS_IGNORED)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What the hub client raises when the hub does not answer: OSError, and the transport
    errors of the HTTP library huggingface_hub uses (httpx before 2.0, httpx2 since)."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx", "httpx2"):
        with contextlib.suppress(ImportError):
            errors.append(importlib.import_module(name).TransportError)
    return tuple(errors)


def _repo_files(model: str, revision: str | None) -> list[str] | None:
    """The repository's file names, or None when the hub cannot be reached or is unwell (429,
    5xx: the cache may serve). The hub's answers about the model (no such repository, a gated
    one) are raised. One request: the model's info lists its files, where `list_repo_files`
    retries an unreachable hub five times with backoff (about 24 s before the cache serves)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(model, revision=revision, expand=["siblings"])
        return [sibling.rfilename for sibling in info.siblings or []]
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 429 or (status is not None and status >= 500):
            return None
        raise
    except _transport_errors():  # offline, or no answer: the cache may still serve
        return None


def resolve_model(model: str, revision: str | None = None, cache_dir: str | None = None
                  ) -> ModelSource:
    """The directory to load `model` from: itself when it is a directory, else the hub
    snapshot of `revision` (downloaded when missing, unless HF_HUB_OFFLINE is set). Raises
    ValueError with what was looked for when it cannot be found."""
    check_model_name(model, revision)
    if Path(model).is_dir():
        return ModelSource(model)
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline_mode()
    where = cache_dir or constants.HF_HUB_CACHE
    rev = revision or "main"
    try:
        if offline:
            path = snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                     local_files_only=True)
        else:
            files = _repo_files(model, revision)
            offline = files is None  # unreachable: the cached snapshot, as vLLM falls back
            path = snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                     local_files_only=offline,
                                     ignore_patterns=download_ignore_patterns(files or []))
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if is_offline_mode() else "the hub cannot be reached"
        get = f"hf download {model}" + (f" --revision {revision}" if revision else "")
        raise ValueError(f"model {model!r} (revision {rev}) is not in the Hugging Face cache "
                         f"{where} on this machine and {how}: run `{get}` on a machine that "
                         "reaches the hub and copy its cache here, set HF_HOME to a cache that "
                         "holds it, or pass the model's directory") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ValueError(f"model {model!r}: no such repository on the Hugging Face hub, or "
                         f"access needs a token (HF_TOKEN): {exc}") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {model!r} has no revision {rev!r}") from None
    except HfHubHTTPError as exc:
        raise ValueError(f"model {model!r}: the Hugging Face hub answered {exc}") from None
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model {model!r}: snapshot {path} has no config.json")
    return ModelSource(str(path), model, Path(path).name)
