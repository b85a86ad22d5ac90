"""`--model-id org/name`: the launcher downloads from the Hub (a stand-in on loopback) once, then serves the snapshot;
the cache serves again offline; a revision picks its own files; every failure is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ORACLE_PROMPTS, greedy_reference, start_server
from hub_standin import StandInHub, point_hub_at

from conveyor import adapter_sources, hub
from conveyor.model_source import resolve_model

REPO = "conveyor-test/tiny"


@pytest.fixture
def standin(tiny_model: Path, tmp_path: Path) -> StandInHub:
    """The tiny model as a Hub repo (with a PyTorch copy of its weights serving must not fetch), a `v2` revision
    that differs in one file, and a gated repo."""
    main = tmp_path / "repo-main"
    shutil.copytree(tiny_model, main)
    (main / "pytorch_model.bin").write_bytes(b"weights serving never reads")
    v2 = tmp_path / "repo-v2"
    shutil.copytree(main, v2)
    (v2 / "tokenizer_config.json").write_text((main / "tokenizer_config.json").read_text().replace("{", '{"v2": 1,', 1))
    standin = StandInHub()
    standin.add_repo(REPO, main, revisions={"v2": v2})
    standin.add_repo("conveyor-test/gated", main, gated=True)
    with standin:
        yield standin


def hub_env(standin_url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return dict(env, HF_ENDPOINT=standin_url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", **extra)


def test_serves_a_hub_model_then_serves_it_offline(standin: StandInHub, tiny_model: Path, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    prompt, n = ORACLE_PROMPTS[0]
    want = greedy_reference(tiny_model, prompt, n)
    for env in (hub_env(standin.url, home), hub_env(standin.url, home, HF_HUB_OFFLINE="1")):
        asked_before = len(standin.requests)
        server = start_server(REPO, env=env)  # type: ignore[arg-type]  # an id, not a directory
        try:
            assert server.info()["model_id"] == REPO
            body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
            answer = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
            assert [t["id"] for t in answer["details"]["tokens"]] == want
        finally:
            assert server.stop() == 0
        if env.get("HF_HUB_OFFLINE"):
            assert len(standin.requests) == asked_before, "offline, nothing may be asked of the Hub"
    fetched = [r for r in standin.requests if "/resolve/" in r]
    assert fetched and not any(r.endswith(".bin") for r in fetched), "only what serving reads is downloaded"
    snapshot = home / "hub" / "models--conveyor-test--tiny" / "snapshots" / standin.commit(REPO)
    assert (snapshot / "config.json").exists() and not (snapshot / "pytorch_model.bin").exists()


def test_a_revision_gets_its_own_snapshot(standin: StandInHub, tmp_path: Path, monkeypatch) -> None:
    point_hub_at(monkeypatch, standin, tmp_path / "hf")
    main = resolve_model(REPO, "tiny")
    v2 = resolve_model(REPO, "tiny", revision="v2")
    assert main.name == standin.commit(REPO) and v2.name == standin.commit(REPO, "v2")
    assert json.loads((v2 / "tokenizer_config.json").read_text())["v2"] == 1
    assert "v2" not in json.loads((main / "tokenizer_config.json").read_text())
    assert resolve_model(str(main), "tiny") == main  # a local directory is used as it is


def test_an_adapter_from_the_hub_is_fetched_as_its_two_files(
    standin: StandInHub, lora_adapters: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    """`--lora-adapters name=org/repo` (and a live load of a Hub id): the adapter's config and weights, nothing
    else of the repo, through the same download as a model's."""
    repo = tmp_path / "adapter-repo"
    shutil.copytree(lora_adapters["qv"], repo)
    (repo / "training_args.bin").write_bytes(b"never read by serving")
    standin.add_repo("conveyor-test/qv-lora", repo)
    point_hub_at(monkeypatch, standin, tmp_path / "hf")
    folder = adapter_sources.resolve("conveyor-test/qv-lora")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert adapter_sources.resolve(str(lora_adapters["qv"])) == lora_adapters["qv"]  # a directory as it is
    with pytest.raises(hub.HubError, match="no local directory of that name"):
        adapter_sources.resolve("conveyor-test/no-such-lora")


def launch(model_id: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """The launcher up to the download, which fails before any child starts."""
    return subprocess.run(
        [sys.executable, "-m", "conveyor.launcher.main", "--model-id", model_id, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("model_id", "flags", "extra", "says"),
    [
        ("conveyor-test/gated", (), {}, "is gated: accept its terms on the Hub and set HF_TOKEN"),
        (
            "conveyor-test/missing",
            (),
            {},
            "no local directory of that name, and no such model on the Hub, or it is private",
        ),
        (REPO, ("--revision", "v9"), {}, "has no revision 'v9'"),
        (REPO, (), {"HF_HUB_OFFLINE": "1"}, "is not in the local cache and the Hub cannot be reached"),
        ("no/such/thing", (), {}, "no config.json there, and not a Hub id"),
    ],
    ids=["gated", "missing-repo", "missing-revision", "offline-uncached", "not-an-id"],
)
def test_failures_are_one_line(
    standin: StandInHub, tmp_path: Path, model_id: str, flags: tuple, extra: dict, says: str
) -> None:
    done = launch(model_id, hub_env(standin.url, tmp_path / "hf", **extra), *flags)
    assert done.returncode == 1
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not list((tmp_path / "hf").glob("hub/*/snapshots/*/config.json"))


def test_no_network_is_one_line(tmp_path: Path) -> None:
    """A Hub that does not answer (a closed loopback port) and nothing cached."""
    with StandInHub() as closed:
        url = closed.url
    done = launch(REPO, hub_env(url, tmp_path / "hf"))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and REPO in done.stderr, done.stderr


def test_gated_repo_opens_with_a_token(standin: StandInHub, tmp_path: Path, monkeypatch) -> None:
    point_hub_at(monkeypatch, standin, tmp_path / "hf")
    monkeypatch.setenv("HF_TOKEN", standin.token)
    assert (resolve_model("conveyor-test/gated", "tiny") / "config.json").exists()


def test_repo_ids_and_paths() -> None:
    assert hub.is_repo_id("Qwen/Qwen3-0.6B") and hub.is_repo_id("meta-llama/Llama-3.2-1B-Instruct")
    assert not any(hub.is_repo_id(s) for s in ("demo", "/models/m", "./m", "a/b/c", "../x", "a/.."))


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("sql", "--lora-adapters 'sql': expected NAME=SOURCE"),
        ("a b=/x", "adapter name 'a b'"),
        ("sql=conveyor-test/missing-lora", "no local directory of that name, and no such model on the Hub"),
        ("sql=/no/such/adapter", "no adapter_config.json there, and not a Hub id"),
    ],
    ids=["no-source", "bad-name", "missing-repo", "missing-directory"],
)
def test_a_bad_lora_adapter_flag_is_one_line(
    standin: StandInHub, tiny_model: Path, tmp_path: Path, flag: str, says: str
) -> None:
    done = launch(str(tiny_model), hub_env(standin.url, tmp_path / "hf"), "--lora-adapters", flag)
    assert done.returncode == 1
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_adapter_source_shaped_like_a_hub_id_does_not_tell_whether_that_path_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative `org/name` with no adapter in it goes to the Hub whether or not the folder exists (before, an
    existing one was refused as "not a Hub id", telling the caller the path was there)."""
    from conveyor import adapter_sources

    asked: list[str] = []

    def download(source: str, **_) -> Path:
        asked.append(source)
        raise hub.HubError(f"{source}: no local directory of that name, and no such model on the Hub")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "download", download)
    (tmp_path / "exists" / "here").mkdir(parents=True)
    answers = []
    for source in ("exists/here", "absent/there"):
        with pytest.raises(hub.HubError) as raised:
            adapter_sources.resolve(source)
        answers.append(str(raised.value).replace(source, "SOURCE"))
    assert asked == ["exists/here", "absent/there"] and answers[0] == answers[1]
