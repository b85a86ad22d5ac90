"""A TGI deployment moved to Conveyor by changing its image: configured by TGI's environment variables alone, served
to TGI's own client, its /info fields and the metric names TGI's Grafana dashboard reads
(tgi_dashboard_metrics.txt: the names only) present; what TGI has and Conveyor does not is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import Server, free_port, wait_until_serving
from prometheus_client.parser import text_string_to_metric_families
from text_generation import Client

DASHBOARD = Path(__file__).with_name("tgi_dashboard_metrics.txt").read_text().split()
LAUNCHER = [sys.executable, "-m", "conveyor.launcher.main"]


def _environment(**tgi: str) -> dict[str, str]:
    return {**os.environ, "CONVEYOR_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", **tgi}


@pytest.fixture(scope="module")
def tgi_server(tiny_model: Path) -> Server:
    port = free_port()
    env = _environment(
        MODEL_ID=str(tiny_model), PORT=str(port), NUM_SHARD="1", MAX_INPUT_TOKENS="64", MAX_TOTAL_TOKENS="96"
    )
    process = subprocess.Popen(LAUNCHER, env=env)
    server = Server(f"http://127.0.0.1:{port}", process, tiny_model, "")
    wait_until_serving(server, "the server started by TGI's environment to answer /health")
    yield server
    server.stop()


def test_tgi_client_generates_and_streams(tgi_server: Server) -> None:
    client = Client(tgi_server.url, timeout=60)
    answer = client.generate("def hello():", max_new_tokens=5)
    assert answer.details.generated_tokens >= 1
    streamed = [r for r in client.generate_stream("def hello():", max_new_tokens=5) if not r.token.special]
    assert "".join(r.token.text for r in streamed) == answer.generated_text


def test_info_has_tgis_fields_and_the_environment_limits(tgi_server: Server) -> None:
    info = httpx.get(f"{tgi_server.url}/info").json()
    for name in (
        "model_id", "model_sha", "model_dtype", "model_device_type", "model_pipeline_tag", "max_concurrent_requests",
        "max_best_of", "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
        "max_client_batch_size", "router", "version", "sha", "docker_label",
    ):  # fmt: skip
        assert name in info, name
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (64, 96)
    assert info["engine"]  # Conveyor's own fields stay


def test_every_metric_the_dashboard_reads_is_served(tgi_server: Server) -> None:
    assert httpx.post(
        f"{tgi_server.url}/generate", json={"inputs": "x = 1", "parameters": {"max_new_tokens": 3}}, timeout=60
    ).is_success
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{tgi_server.url}/metrics").text)}
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    missing = [name for name in DASHBOARD if name not in samples and f"{name}_count" not in samples]
    assert not missing
    assert samples["tgi_request_success"] >= 1
    assert samples["tgi_request_generated_tokens_count"] >= 1
    assert samples["tgi_request_input_length_sum"] > 0
    assert families["tgi_request_duration"].type == "histogram"
    assert families["tgi_queue_size"].type == "gauge"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [(["--max-best-of", "2"], {}, "--max-best-of"), ([], {"QUANTIZE": "awq"}, "awq")],
)
def test_what_conveyor_lacks_is_refused_by_name(argv: list[str], env: dict[str, str], named: str) -> None:
    run = subprocess.run(
        [*LAUNCHER, *argv], env=_environment(MODEL_ID="demo", **env), capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0
    assert named in run.stderr.strip().splitlines()[-1]
