"""Router and shard as separate processes over TCP, the way two containers or two hosts run them: mutual TLS and
the shared token on every call. A caller without the token (or without a certificate, or in plaintext) is
refused; a shard told to listen on loopback listens there and on no other address (read from its own sockets:
tests send traffic to loopback only); neither process starts on TCP without a token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
import httpx
import loopback
import psutil
import pytest
from conftest import ORACLE_PROMPTS, Tls, free_port, greedy_reference, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.router.main import main as router_main
from conveyor.shard.main import main as shard_main
from conveyor.shard_channels import TOKEN_METADATA
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

TOKEN = "test-shard-token"


@dataclass
class Split:
    shard_port: int
    shard_pid: int
    url: str
    tls: Tls


@dataclass
class Child:
    process: subprocess.Popen
    log: IO[bytes]  # its stderr: a file, not a pipe, which nobody reads while it runs and which would fill up

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode()

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(60)


def _spawn(script: str, *args: str, token: str | None = TOKEN) -> Child:
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_SHARD_TOKEN"}
    env.update(CONVEYOR_LOG_LEVEL="WARNING", RANK="0", WORLD_SIZE="1")
    if token is not None:
        env["CONVEYOR_SHARD_TOKEN"] = token
    log = tempfile.TemporaryFile()
    return Child(subprocess.Popen([sys.executable, "-m", f"conveyor.{script}.main", *args], env=env, stderr=log), log)


@pytest.fixture(scope="module")
def split(tiny_model: Path, tls: Tls) -> Iterator[Split]:
    shard_port, http_port = free_port(), free_port()
    shard = _spawn("shard", "--model-id", str(tiny_model), "--listen", f"tcp://127.0.0.1:{shard_port}", *tls.flags)
    router = _spawn(
        "router",
        *("--model-id", str(tiny_model), "--port", str(http_port), "--max-total-tokens", "512"),
        *("--max-batch-prefill-tokens", "1024", "--max-batch-total-tokens", "8192"),
        *("--shard-address", f"tcp://127.0.0.1:{shard_port}", *tls.flags),
    )
    split = Split(shard_port, shard.process.pid, f"http://127.0.0.1:{http_port}", tls)

    def ready() -> bool:
        for name, child in (("shard", shard), ("router", router)):
            if child.process.poll() is not None:
                raise RuntimeError(f"the {name} exited with {child.process.returncode}: {child.stderr()}")
        try:
            return httpx.get(f"{split.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 180, "the router to reach the shard over TCP and answer /health")
    except BaseException:
        router.stop(), shard.stop()
        raise
    yield split
    assert router.stop() == 0, router.stderr()
    assert shard.stop() == 0, shard.stderr()


def test_the_router_serves_through_a_tcp_shard_with_tls_and_token(split: Split, tiny_model: Path) -> None:
    with httpx.Client(base_url=split.url, timeout=120) as client:
        for prompt, max_new_tokens in ORACLE_PROMPTS[:3]:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "decoder_input_details": False}}
            response = client.post("/generate", json={**body, "parameters": {**body["parameters"], "details": True}})
            assert response.status_code == 200, response.text
            tokens = [t["id"] for t in response.json()["details"]["tokens"]]
            assert tokens == greedy_reference(tiny_model, prompt, max_new_tokens), prompt


def _info(split: Split, metadata: list[tuple[str, str]], client_certificate: bool = True) -> grpc.RpcError | None:
    target = f"127.0.0.1:{split.shard_port}"
    with grpc.secure_channel(target, split.tls.credentials(client_certificate)) as channel:
        try:
            pb_grpc.ShardStub(channel).Info(pb.InfoRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return error
    return None


def test_a_caller_without_the_token_is_refused(split: Split) -> None:
    assert _info(split, [(TOKEN_METADATA, TOKEN)]) is None
    for metadata in ([], [(TOKEN_METADATA, "wrong")], [(TOKEN_METADATA, TOKEN[:-1])]):
        error = _info(split, metadata)
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert "shard token" in error.details()


def test_health_answers_probes_without_a_token(split: Split) -> None:
    with grpc.secure_channel(f"127.0.0.1:{split.shard_port}", split.tls.credentials()) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_certificate_less_callers_get_no_connection(split: Split) -> None:
    """Mutual TLS: the shard was given a CA, so it demands a client certificate signed by it."""
    with grpc.insecure_channel(f"127.0.0.1:{split.shard_port}") as channel:
        with pytest.raises(grpc.RpcError) as plaintext:
            pb_grpc.ShardStub(channel).Info(pb.InfoRequest(), timeout=10, metadata=[(TOKEN_METADATA, TOKEN)])
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    error = _info(split, [(TOKEN_METADATA, TOKEN)], client_certificate=False)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE


def test_a_shard_told_to_listen_on_loopback_listens_on_loopback_only(split: Split) -> None:
    """Its listening sockets, as the kernel reports them: probing another address of this machine would send
    traffic off loopback, which tests never do. A wildcard bind (0.0.0.0, ::) would show here as such; gRPC's
    IPv6 socket shows its IPv4 address as ::ffff:127.0.0.1."""
    listening = {
        (str(loopback.ip(c.laddr.ip)), c.laddr.port)
        for c in psutil.Process(split.shard_pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert ("127.0.0.1", split.shard_port) in listening, listening
    assert all(ip == "127.0.0.1" for ip, _ in listening), listening


@pytest.mark.parametrize("main, flag", [(shard_main, "--listen"), (router_main, "--shard-address")])
def test_no_process_goes_on_tcp_without_a_token(main, flag: str, tiny_model: Path, monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_SHARD_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="CONVEYOR_SHARD_TOKEN"):
        main(["--model-id", str(tiny_model), flag, f"tcp://127.0.0.1:{free_port()}"])
