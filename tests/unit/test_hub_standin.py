"""The stand-in Hub (tests/hub_standin.py) is one the real huggingface_hub downloads from: in this process once
`point_hub_at` has set its import-time constants, and in a subprocess from the environment alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from hub_standin import StandInHub, fake_commit, point_hub_at
from huggingface_hub import errors

REPO = "conveyor-tests/tiny"
GATED = "conveyor-tests/gated"
SERVED = ["*.json", "*.safetensors"]  # what a server reads; a repo often holds the same weights twice


def write_model(folder: Path, hidden: int) -> Path:
    """A model folder as repos hold them: config, safetensors weights, tokenizer files, and pickled weights too."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    save_file(
        {"embed.weight": torch.arange(hidden * 2, dtype=torch.float32).reshape(2, hidden)}, folder / "model.safetensors"
    )
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "pytorch_model.bin").write_bytes(b"pickled weights nobody should fetch")
    return folder


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHub]:
    """A stand-in serving REPO (main, and v2 with other weights) and GATED, with the library pointed at it."""
    main = write_model(tmp_path / "main", hidden=4)
    with StandInHub() as hub:
        hub.add_repo(REPO, main, revisions={"v2": write_model(tmp_path / "v2", hidden=8)})
        hub.add_repo(GATED, main, gated=True)
        point_hub_at(monkeypatch, hub, tmp_path / "hf")
        yield hub


def download(repo_id: str = REPO, **kwargs: object) -> Path:
    return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=SERVED, **kwargs))


def test_snapshot_download_fetches_the_allowed_files_into_hf_home(hub: StandInHub, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = download(revision="main")

    assert folder == tmp_path / "hf" / "hub" / "models--conveyor-tests--tiny" / "snapshots" / fake_commit(REPO, "main")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == (tmp_path / "main" / name).read_bytes()
    assert load_file(folder / "model.safetensors")["embed.weight"].shape == (2, 4)
    assert not [r for r in hub.requests if r.endswith(".bin")]


def test_a_revision_is_served_by_name_and_by_commit(hub: StandInHub) -> None:
    by_name = download(revision="v2")
    by_commit = download(revision=hub.commit(REPO, "v2"))

    assert by_name.name == by_commit.name == hub.commit(REPO, "v2") != hub.commit(REPO)
    assert json.loads((by_name / "config.json").read_text())["hidden_size"] == 8


def test_a_gated_repo_opens_to_its_token_only(hub: StandInHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(errors.GatedRepoError):
        download(GATED)
    with pytest.raises(errors.GatedRepoError):
        download(GATED, token="hf_wrong")

    assert (download(GATED, token=hub.token) / "model.safetensors").is_file()
    monkeypatch.setenv("HF_TOKEN", hub.token)  # what a user sets: read at each call
    assert (download(GATED) / "config.json").is_file()


def test_an_unknown_repo_is_not_found(hub: StandInHub) -> None:
    with pytest.raises(errors.RepositoryNotFoundError) as raised:
        download("conveyor-tests/absent")
    assert type(raised.value) is errors.RepositoryNotFoundError  # not its subclass GatedRepoError


def test_an_unknown_revision_is_not_found(hub: StandInHub) -> None:
    with pytest.raises(errors.RevisionNotFoundError):
        download(revision="no-such-branch")


def test_a_missing_file_is_not_found(hub: StandInHub) -> None:
    with pytest.raises(errors.RemoteEntryNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "absent.json")


def test_offline_the_cache_answers_without_a_request(
    hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = download()
    point_hub_at(monkeypatch, hub, tmp_path / "hf", offline=True)
    asked = len(hub.requests)

    assert download() == folder
    with pytest.raises(errors.LocalEntryNotFoundError):
        download(revision="v2")  # never fetched: not in the cache
    assert hub.requests[asked:] == []


def test_a_subprocess_finds_the_stand_in_through_the_environment(hub: StandInHub, tmp_path: Path) -> None:
    code = f"import huggingface_hub; print(huggingface_hub.snapshot_download({REPO!r}, allow_patterns={SERVED!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)

    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder.parent == tmp_path / "hf" / "hub" / "models--conveyor-tests--tiny" / "snapshots"
    assert (folder / "model.safetensors").read_bytes() == (tmp_path / "main" / "model.safetensors").read_bytes()
    assert any(r.startswith("GET /conveyor-tests/tiny/resolve/") for r in hub.requests)
