"""A model named as a local directory or as a Hugging Face Hub repo id (``ORG/NAME``), resolved to a local directory.

    resolve_model("Qwen/Qwen3-8B")            -> ModelSource(path=<cache>/models--Qwen--Qwen3-8B/snapshots/<commit>,
                                                             repo_id="Qwen/Qwen3-8B", revision=<commit>)
    resolve_model(".models/smollm2-135m")     -> ModelSource(path=.models/smollm2-135m, repo_id=None, revision=None)

The one place kvrelay reaches a model hub; every entry point (`kvrelay serve|up|generate|router|prefill|decode`,
``LLM()``) calls `resolve_model` before it loads anything, and everything after it (`model.loader`,
`model.tokenizer`, the router) reads a local directory only.

Rules, in order:

1. A path that exists locally is that directory, whatever it looks like (``Qwen/Qwen3-8B`` under the working
   directory wins over the hub).
2. Otherwise a valid repo id of the form ``ORG/NAME`` goes to the hub through `huggingface_hub.snapshot_download`,
   which honours ``HF_HOME`` / ``HF_HUB_CACHE`` (the cache), ``HF_TOKEN`` (gated and private repos),
   ``HF_HUB_OFFLINE`` (cache only), ``HF_ENDPOINT`` (a mirror) and shows its progress bars on stderr. Only the files
   the loader reads are fetched (`ALLOW_PATTERNS`). With the hub unreachable, a snapshot already in the cache for
   the revision is used (as ``huggingface_hub`` does).
3. Anything else (``gpt2``, ``./missing``, ``a/b/c``) is a local path that does not exist: returned as given,
   for the loader to report as a missing model directory.

Failures raise `HubError`, whose message names the model and says what to do; no ``huggingface_hub`` exception
escapes. ``huggingface_hub`` reads its environment variables when it is first imported.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# What `model.loader`, `model.config` and `model.tokenizer` read; nothing else is downloaded (no *.bin, *.pth,
# *.gguf, original/, onnx/ ...).
ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
)


_NAME = r"\w(?:[\w.-]*\w)?"
REPO_ID = re.compile(rf"{_NAME}/{_NAME}", re.ASCII)


class HubError(Exception):
    """A hub repo id could not be resolved to a local directory; the message names the model and what to do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files are.

    Attributes:
        path: the local directory to load (``config.json``, safetensors, tokenizer files); for a name that is
            neither an existing path nor a repo id, the name itself (it does not exist).
        repo_id: the hub repo it came from (``ORG/NAME``); None for a local directory.
        revision: the commit of the snapshot in ``path``; None for a local directory.
    """

    path: Path
    repo_id: str | None = None
    revision: str | None = None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub repo id ``ORG/NAME``: exactly one ``/`` between two names the hub accepts
    (letters, digits, ``_``, ``-``, ``.``; starting and ending with a letter, digit or ``_``; no ``--`` or ``..``;
    96 characters at most, not ending in ``.git``: ``huggingface_hub.utils.validate_repo_id``'s rules, checked here
    without importing it). Says nothing about whether such a repo exists, or a local path of that name."""
    return (bool(REPO_ID.fullmatch(name)) and len(name) <= 96 and "--" not in name and ".." not in name
            and not name.endswith(".git"))


def resolve_model(name: str | Path, *, revision: str | None = None,
                  download_dir: str | Path | None = None) -> ModelSource:
    """The local directory of model ``name`` (see the module doc for the rules).

    ``revision``: a branch, tag or commit of the hub repo (default ``main``); ignored for a local path.
    ``download_dir``: the hub cache to read and fill (default: ``huggingface_hub``'s, under ``HF_HOME``).
    A repo id prints one line naming what is fetched from where, then ``huggingface_hub``'s progress bars, on
    stderr (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides the bars).

    Raises:
        HubError: a repo id that could not be resolved (not found, gated, revision unknown, hub unreachable or
            offline without the snapshot in the cache), naming the model and what to do.
    """
    text = str(name)
    if Path(text).expanduser().exists() or not is_hub_id(text):
        return ModelSource(Path(text).expanduser())
    return _from_hub(text, revision=revision, download_dir=download_dir)


def _from_hub(repo_id: str, *, revision: str | None, download_dir: str | Path | None) -> ModelSource:
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(download_dir).expanduser() if download_dir is not None else Path(constants.HF_HUB_CACHE)
    at = f" at revision {revision!r}" if revision else ""
    what = f"model {repo_id!r}{at}"
    offline = constants.HF_HUB_OFFLINE
    where = "the hub cache only (HF_HUB_OFFLINE is set)" if offline else constants.ENDPOINT
    print(f"kvrelay: fetching {what} from {where} into {cache}", file=sys.stderr, flush=True)
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(ALLOW_PATTERNS)))
    except GatedRepoError:
        raise HubError(f"{what} is gated on the Hugging Face Hub: accept its license on the model's page, then set "
                       f"HF_TOKEN to a token of that account") from None
    except RevisionNotFoundError:
        raise HubError(f"{what}: the hub has no such revision; check --revision (model.revision): a branch, tag or "
                       f"commit of the repo") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} was not found on the Hugging Face Hub ({constants.ENDPOINT}): check the name, or "
                       f"set HF_TOKEN if it is private; a local directory of that name does not exist either") from None
    except IncompleteSnapshotError:
        raise HubError(f"{what}: its snapshot in the hub cache {cache} misses files kvrelay reads (an interrupted "
                       f"download) and the hub could not complete it: run again with the hub reachable (unset "
                       f"HF_HUB_OFFLINE), or `hf download {repo_id}`") from None
    except LocalEntryNotFoundError as exc:
        if offline or isinstance(exc.__cause__, OfflineModeIsEnabled):
            raise HubError(f"{what} is not in the hub cache {cache} and HF_HUB_OFFLINE is set: download it first "
                           f"(`hf download {repo_id}` on a machine with access, into this cache, or pass "
                           f"--download-dir), or unset HF_HUB_OFFLINE") from None
        cause = exc.__cause__ or exc
        raise HubError(f"{what} could not be fetched from {constants.ENDPOINT} ({type(cause).__name__}) and is not "
                       f"in the hub cache {cache}: check the network or HF_ENDPOINT, set HF_TOKEN for a gated or "
                       f"private repo, or download it first (`hf download {repo_id}`) and set HF_HUB_OFFLINE=1"
                       ) from None
    except (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError) as exc:  # the hub's answer, a proxy, a full disk
        raise HubError(f"{what} could not be fetched from {constants.ENDPOINT}: {type(exc).__name__}: {exc}; check "
                       f"the network, the disk and HF_TOKEN, or download it first (`hf download {repo_id}`)") from None
    if not (path / "config.json").is_file():
        raise HubError(f"{what}: the snapshot {path} has no config.json; it is not a Transformers model repo")
    return ModelSource(path, repo_id=repo_id, revision=path.name)

