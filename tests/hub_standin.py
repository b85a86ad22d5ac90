"""A stand-in for the Hugging Face Hub on loopback, that the installed `huggingface_hub` accepts as `HF_ENDPOINT`.

The tests download models with the real `huggingface_hub.snapshot_download` (the launcher does), yet may not leave
loopback (tests/loopback.py): so this serves folders of files the way the Hub serves repos, with just the endpoints
and headers a download reads:

- `GET /api/models/{org}/{name}[/revision/{revision}]`: the repo info (`sha`, `siblings`), which resolves a branch
  name to its commit;
- `GET /api/models/{org}/{name}/tree/{revision}[/{path}][?recursive=true]`: the file listing, with sizes, git blob ids
  and the LFS sha256 of weight files (`snapshot_download` filters it with allow_patterns and caches it on disk);
- `HEAD` and `GET /{org}/{name}/resolve/{revision}/{path}`: a file, with `X-Repo-Commit`, `ETag` (the git blob id;
  the sha256 for LFS files, also as `X-Linked-Etag` / `X-Linked-Size`), `Content-Length`, and byte ranges (a resumed
  download asks for one). No Xet headers, so the library downloads over plain HTTP.

Errors carry the `X-Error-Code` header that `huggingface_hub.utils.hf_raise_for_status` turns into its exceptions:
`RepoNotFound` (RepositoryNotFoundError), `GatedRepo` (GatedRepoError), `RevisionNotFound` (RevisionNotFoundError),
`EntryNotFound` (RemoteEntryNotFoundError). Never a 5xx: the library retries those, sleeping in between.

Responses are HTTP/1.0 (one request per connection), so that no kept-alive connection of the library's shared
client outlives the server (a handler thread would sit on it) and `__exit__` stops at once.

`point_hub_at` points the library at a stand-in, both for subprocesses (the environment) and for this process,
where `huggingface_hub` read its environment once, at import (see there).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

# What the Hub's default .gitattributes sends to LFS (and, as on the Hub, anything of 10 MiB or more).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".model")
LFS_MIN_SIZE = 10 * 1024 * 1024

LAST_MODIFIED = "2024-01-01T00:00:00.000Z"


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob: what the Hub lists as a file's `oid` and sends as a regular file's ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The pointer git stores for an LFS file: its blob id is the file's `oid` in the tree listing."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def fake_commit(repo_id: str, revision: str) -> str:
    """A fixed 40-hex commit sha per repo and revision name, so that a test can predict the snapshot folder."""
    return hashlib.sha1(f"stand-in commit {repo_id}@{revision}".encode()).hexdigest()


@dataclass(frozen=True)
class RepoFile:
    """One file of a revision, read once at add_repo so that its content always matches its ETag."""

    path: str
    data: bytes
    blob_id: str
    sha256: str | None  # set for LFS files

    @classmethod
    def read(cls, path: str, disk: Path) -> RepoFile:
        data = disk.read_bytes()
        if not (path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE):
            return cls(path, data, git_blob_id(data), None)
        sha256 = hashlib.sha256(data).hexdigest()
        return cls(path, data, git_blob_id(lfs_pointer(sha256, len(data))), sha256)

    def lfs(self) -> dict[str, Any] | None:
        """The `lfs` object of a tree entry (`oid` is the sha256), or None for a regular file."""
        if self.sha256 is None:
            return None
        return {"oid": self.sha256, "size": len(self.data), "pointerSize": len(lfs_pointer(self.sha256, 0))}

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": len(self.data), "path": self.path}
        if self.sha256 is not None:
            entry["lfs"] = self.lfs()
        return entry

    def sibling(self) -> dict[str, Any]:
        """The repo info's form (`rfilename`, `blobId`, and `sha256` where the tree says `oid`)."""
        lfs = self.lfs()
        sibling: dict[str, Any] = {"rfilename": self.path, "size": len(self.data), "blobId": self.blob_id}
        if lfs is not None:
            sibling["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
        return sibling


@dataclass(frozen=True)
class Revision:
    name: str
    sha: str
    files: dict[str, RepoFile]

    @classmethod
    def read(cls, repo_id: str, name: str, folder: Path) -> Revision:
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder")
        paths = sorted(p for p in folder.rglob("*") if p.is_file())
        files = {p.relative_to(folder).as_posix(): p for p in paths}
        return cls(name, fake_commit(repo_id, name), {rel: RepoFile.read(rel, disk) for rel, disk in files.items()})

    def folders(self) -> list[str]:
        """Every folder that holds a file, for the tree listing's `directory` entries."""
        parents = {"/".join(path.split("/")[:i]) for path in self.files for i in range(1, path.count("/") + 1)}
        return sorted(parents)


@dataclass(frozen=True)
class Repo:
    repo_id: str
    revisions: dict[str, Revision]  # by name
    gated: bool

    def revision(self, name_or_sha: str) -> Revision | None:
        """A revision by its name or by its commit sha, as the Hub resolves both."""
        if name_or_sha in self.revisions:
            return self.revisions[name_or_sha]
        return next((r for r in self.revisions.values() if r.sha == name_or_sha), None)

    def info(self, revision: Revision) -> dict[str, Any]:
        org, _ = self.repo_id.split("/")
        return {
            "_id": fake_commit(self.repo_id, "")[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "author": org,
            "sha": revision.sha,
            "lastModified": LAST_MODIFIED,
            "createdAt": LAST_MODIFIED,
            "private": False,
            "gated": "auto" if self.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [f.sibling() for f in revision.files.values()],
        }


class HubError(Exception):
    """An error answer: status, the X-Error-Code that huggingface_hub maps to an exception, a message."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def json_answer(value: Any) -> Answer:
    return Answer(200, {"Content-Type": "application/json"}, json.dumps(value).encode())


class StandInHub:
    """Serves folders as Hub model repos on 127.0.0.1 (a free port) while entered; see the module docstring."""

    def __init__(self) -> None:
        self.token = "hf_standin_token"
        self.url = ""
        self.requests: list[str] = []
        self._repos: dict[str, Repo] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def add_repo(
        self, repo_id: str, folder: Path, *, revisions: dict[str, Path] | None = None, gated: bool = False
    ) -> None:
        """Serves `folder`'s files as repo_id at revision 'main' (and each extra revision name -> its folder). Each
        revision gets a fixed fake 40-hex commit sha (deterministic from repo and revision name). A gated repo
        answers 401 with X-Error-Code: GatedRepo to everything unless the request carries
        'Authorization: Bearer <token>' equal to self.token."""
        if not REPO_ID.fullmatch(repo_id):
            raise ValueError(f"repo id {repo_id!r} is not of the form org/name")
        extra = revisions or {}
        if "main" in extra:
            raise ValueError("'main' is `folder`; name the other revisions in `revisions`")
        folders = {"main": Path(folder), **{name: Path(path) for name, path in extra.items()}}
        read = {name: Revision.read(repo_id, name, path) for name, path in folders.items()}
        self._repos[repo_id] = Repo(repo_id, read, gated)

    def commit(self, repo_id: str, revision: str = "main") -> str:
        """The commit sha a revision is served at (the name of its snapshot folder in the cache)."""
        return self._repos[repo_id].revisions[revision].sha

    def __enter__(self) -> StandInHub:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"
        # The socket listens already: a request sent before the thread runs waits in the backlog.
        self._thread = threading.Thread(target=self._server.serve_forever, name="stand-in hub", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def answer(self, method: str, target: str, authorization: str | None, range_header: str | None) -> Answer:
        """The answer to one request (the handler only moves bytes); errors become their HubError answer."""
        split = urlsplit(target)
        self.requests.append(f"{method} {split.path}")
        segments = split.path.split("/")[1:]
        try:
            if segments[:1] == ["api"]:
                return self._api(segments[1:], parse_qs(split.query), authorization)
            if "resolve" in segments:
                return self._resolve(segments, authorization, range_header)
            raise HubError(404, None, f"the stand-in Hub has no {split.path}")
        except HubError as error:
            return _error_answer(error)

    def _repo(self, repo_type: str, org: str, name: str, authorization: str | None) -> Repo:
        repo = self._repos.get(f"{unquote(org)}/{unquote(name)}") if repo_type == "models" else None
        if repo is None:
            raise HubError(404, "RepoNotFound", "Repository not found")
        if repo.gated and authorization != f"Bearer {self.token}":
            raise HubError(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted.")
        return repo

    @staticmethod
    def _revision(repo: Repo, name: str) -> Revision:
        revision = repo.revision(unquote(name))
        if revision is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {unquote(name)}")
        return revision

    def _api(self, segments: list[str], query: dict[str, list[str]], authorization: str | None) -> Answer:
        """/api/models/{org}/{name}, .../revision/{rev}, .../tree/{rev}[/{path}]."""
        if len(segments) < 3:
            raise HubError(404, None, "the stand-in Hub has no such API")
        repo = self._repo(segments[0], segments[1], segments[2], authorization)
        rest = segments[3:]
        if not rest:
            return json_answer(repo.info(repo.revisions["main"]))
        if rest[0] == "revision" and len(rest) == 2:
            return json_answer(repo.info(self._revision(repo, rest[1])))
        if rest[0] == "tree" and len(rest) in (2, 3):
            path = unquote(rest[2]).strip("/") if len(rest) == 3 else ""
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return json_answer(_tree(self._revision(repo, rest[1]), path, recursive))
        raise HubError(404, None, "the stand-in Hub has no such API")

    def _resolve(self, segments: list[str], authorization: str | None, range_header: str | None) -> Answer:
        """/{org}/{name}/resolve/{rev}/{path}; a repo type prefix (datasets/...) names no repo here."""
        at = segments.index("resolve")
        if at != 2 or len(segments) < 5:
            raise HubError(404, "RepoNotFound", "Repository not found")
        repo = self._repo("models", segments[0], segments[1], authorization)
        revision = self._revision(repo, segments[3])
        path = "/".join(unquote(s) for s in segments[4:])
        file = revision.files.get(path)
        if file is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision.name}", revision.sha)
        return _file_answer(file, revision.sha, range_header)


def _tree(revision: Revision, path: str, recursive: bool) -> list[dict[str, Any]]:
    """The listing under `path` (all of it when recursive, else its direct children), folders first."""
    prefix = f"{path}/" if path else ""
    if path and path not in revision.folders():
        raise HubError(404, "EntryNotFound", f"{path} is not a folder on {revision.name}")

    def wanted(p: str) -> bool:
        return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

    folders = [{"type": "directory", "oid": git_blob_id(p.encode()), "size": 0, "path": p} for p in revision.folders()]
    files = [f.tree_entry() for f in revision.files.values()]
    return [entry for entry in folders + files if wanted(entry["path"])]


def _file_answer(file: RepoFile, commit: str, range_header: str | None) -> Answer:
    """A file as /resolve sends it: the whole, or the byte range asked for (206)."""
    etag = file.sha256 or file.blob_id
    headers = {
        "Content-Type": "application/octet-stream",
        "ETag": f'"{etag}"',
        "X-Repo-Commit": commit,
        "Accept-Ranges": "bytes",
    }
    if file.sha256 is not None:
        headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(file.data))}
    span = _byte_range(range_header, len(file.data))
    if span is None:
        return Answer(200, headers, file.data)
    start, end = span
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(file.data)}"
    return Answer(206, headers, file.data[start:end])


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end) of a single `bytes=a-b` or `bytes=a-` range, end exclusive; None: send it all."""
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", (header or "").strip())
    if match is None or int(match[1]) >= size:
        return None
    end = min(int(match[2]) + 1, size) if match[2] else size
    return int(match[1]), end


def _error_answer(error: HubError) -> Answer:
    headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
    if error.code is not None:
        headers["X-Error-Code"] = error.code
    if error.commit is not None:
        headers["X-Repo-Commit"] = error.commit
    return Answer(error.status, headers, json.dumps({"error": error.message}).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: StandInHub


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: _Server

    def do_GET(self) -> None:
        self._send(self._answer(), body=True)

    def do_HEAD(self) -> None:
        self._send(self._answer(), body=False)

    def _answer(self) -> Answer:
        return self.server.hub.answer(
            self.command, self.path, self.headers.get("Authorization"), self.headers.get("Range")
        )

    def _send(self, answer: Answer, body: bool) -> None:
        self.send_response(answer.status)
        for name, value in answer.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        if body:
            self.wfile.write(answer.body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: `hub.requests` records what was asked."""


# Environment huggingface_hub reads that would send it elsewhere than the stand-in and the given home.
_CLEARED_ENV = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_ASSETS_CACHE",
    "HUGGINGFACE_ASSETS_CACHE",
    "HF_XET_CACHE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_OIDC_RESOURCE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HUGGINGFACE_CO_STAGING",
)


def point_hub_at(monkeypatch: pytest.MonkeyPatch, hub: StandInHub, home: Path, offline: bool = False) -> None:
    """Points huggingface_hub at `hub` with its cache and token under `home`, for subprocesses (the environment)
    and for this process, where huggingface_hub.constants read the environment once, at import, and a few modules
    copied values from it: those are set too, and monkeypatch restores them all.

    No token is set: pass token=hub.token, or set HF_TOKEN (read at each call). `offline` sets HF_HUB_OFFLINE,
    under which every request raises OfflineModeIsEnabled before it is sent, and only the cache answers."""
    home = Path(home)
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _patch_constants(monkeypatch, hub.url, home, offline)
    _patch_copies(monkeypatch, hub.url, home)


def _patch_constants(monkeypatch: pytest.MonkeyPatch, url: str, home: Path, offline: bool) -> None:
    """What huggingface_hub.constants would hold had the environment been so at import."""
    from huggingface_hub import constants

    values: dict[str, object] = {
        "ENDPOINT": url,
        # hf_hub_url formats this template, not ENDPOINT: left alone, downloads would still go to huggingface.co.
        "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": constants.HF_URL_HOSTS | {urlsplit(url).hostname},
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HUGGINGFACE_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        # is_offline_mode() reads this, and the request hook of the shared client asks is_offline_mode().
        "HF_HUB_OFFLINE": offline,
        # Else the user agent asks {ENDPOINT}/api/agent-harnesses once per process (agent detection).
        "HF_HUB_DISABLE_TELEMETRY": True,
    }
    for name, value in values.items():
        monkeypatch.setattr(constants, name, value)


_COPYING_MODULES = (
    "hf_api",
    "hf_file_system",
    "utils._http",
    "utils._cache_assets",
    "utils._cache_manager",
    "utils._git_credential",
)


def _patch_copies(monkeypatch: pytest.MonkeyPatch, url: str, home: Path) -> None:
    """Values other modules took from huggingface_hub.constants at their import, imported here first so that a
    later import cannot take the stand-in's values for good."""
    modules = {name: importlib.import_module(f"huggingface_hub.{name}") for name in _COPYING_MODULES}
    monkeypatch.setattr(modules["utils._git_credential"], "ENDPOINT", url)
    monkeypatch.setattr(modules["utils._cache_assets"], "HF_ASSETS_CACHE", str(home / "assets"))
    monkeypatch.setattr(modules["utils._cache_manager"], "HF_HUB_CACHE", str(home / "hub"))
    # The module-level functions (huggingface_hub.model_info, list_repo_tree, ...) are methods of this instance.
    monkeypatch.setattr(modules["hf_api"].api, "endpoint", url)
    hffs = modules["hf_file_system"].hffs
    monkeypatch.setattr(hffs, "endpoint", url)
    monkeypatch.setattr(hffs._api, "endpoint", url)
    # Origins whose redirects are followed with the token (the stand-in redirects nowhere; kept true anyway).
    http = modules["utils._http"]
    monkeypatch.setattr(http, "_HUB_ORIGINS", http._HUB_ORIGINS | {http._url_origin(url)})
