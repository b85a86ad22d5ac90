"""OpenTelemetry: a request's router spans and its shard's spans reach an OTLP collector under one trace id,
the caller's, and the gRPC front door honours a traceparent in its metadata too."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import free_port, start_server, wait_for
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conveyor.client import Client


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An in-process OTLP/gRPC collector: every exported span, by trace id, with its service's name."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[str, str]]] = defaultdict(list)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans[span.trace_id.hex()].append((attributes.get("service.name", ""), span.name))
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self, trace_id: str) -> set[tuple[str, str]]:
        with self.lock:
            return set(self.spans.get(trace_id, []))


@pytest.fixture(scope="module")
def collector():
    collector, port = Collector(), free_port()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield collector, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def traced(tiny_model: Path, collector):
    _, endpoint = collector
    server = start_server(tiny_model, "--otlp-endpoint", endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield server
    assert server.stop() == 0


EXPECTED = {
    ("conveyor-router", "validate"),
    ("conveyor-router", "queue"),
    ("conveyor-router", "prefill"),
    ("conveyor-router", "decode"),
    ("conveyor-shard", "shard.Prefill"),
    ("conveyor-shard", "shard.Decode"),
}


def test_an_http_request_is_one_trace_across_router_and_shard(traced, collector) -> None:
    spans, _ = collector
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 3}}
    assert httpx.post(f"{traced.url}/generate", json=body, headers=headers, timeout=60).status_code == 200
    wait_for(
        lambda: (EXPECTED | {("conveyor-router", "POST /generate")}) <= spans.names(trace_id),
        60,
        "router and shard spans under the caller's trace id",
    )


def test_the_grpc_front_door_continues_the_callers_trace(traced, collector) -> None:
    spans, _ = collector
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metadata = [("traceparent", f"00-{trace_id}-b7ad6b7169203331-01")]
    with Client(traced.grpc, timeout=60, metadata=metadata) as client:
        assert client.generate("x", max_new_tokens=2).details.generated_tokens == 2
    wanted = EXPECTED | {("conveyor-router", "conveyor.v1.TextGeneration/Generate")}
    wait_for(lambda: wanted <= spans.names(trace_id), 60, "the gRPC call's spans under the caller's trace id")
