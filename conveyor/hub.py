"""Models from the Hugging Face Hub by id: downloaded once into the standard cache, served from the local snapshot.

`huggingface_hub.snapshot_download` does the work and honours the environment a Hub user already has: `HF_HOME` /
`HF_HUB_CACHE` (where), `HF_TOKEN` (gated and private repos), `HF_ENDPOINT` (a mirror; the tests' stand-in Hub)
and `HF_HUB_OFFLINE=1` (the cache only). Only what serving reads is fetched: a repo often holds the same weights
again as PyTorch `.bin`, GGUF or ONNX files, several times the size of the safetensors. Every way it can fail
ends in one line that says what to do, not a traceback (`HubError`).
"""

from __future__ import annotations

import re
from pathlib import Path

# What serving reads: the config, the generation defaults, the weights, the tokenizer and the chat template, and an
# embedding checkpoint's sentence-transformers modules and pooling (conveyor/pooling.py).
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "modules.json",
    "*Pooling/config.json",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(SystemExit):
    """The model could not be fetched. A SystemExit whose code is the message: uncaught, Python prints that one
    line to stderr and exits with status 1, in the launcher, the router or a shard alike."""


def is_repo_id(model_id: str) -> bool:
    """Whether `model_id` reads as `org/name` (and is not a local path: the caller checks that first)."""
    return bool(REPO_ID.match(model_id)) and ".." not in model_id


def download(
    repo_id: str,
    revision: str | None = None,
    patterns: list[str] = ALLOW_PATTERNS,
    needs: str = "config.json",
    what: str = "a transformers model Conveyor can serve",
) -> Path:
    """The local snapshot of `repo_id` at `revision` (a branch, tag or commit; default main), fetched if the
    cache does not have it, with the library's progress bars on stderr: the files of `patterns`, of which
    `needs` must be one (a LoRA adapter asks for its own two files)."""
    import httpx
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except errors.GatedRepoError:
        raise HubError(
            f"{where} is gated: accept its terms on the Hub and set HF_TOKEN to a token that may read it"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit id)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{repo_id}: no local directory of that name, and no such model on the Hub, or it is private (set HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise HubError(
            f"{where} is not in the local cache and the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1)"
        ) from None
    except (errors.HfHubHTTPError, OSError, httpx.HTTPError, httpx2.HTTPError) as exc:
        raise HubError(f"{where}: download failed: {_first_line(exc)}") from None
    if not (Path(folder) / needs).exists():
        raise HubError(f"{where} has no {needs}: not {what}")
    return Path(folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
