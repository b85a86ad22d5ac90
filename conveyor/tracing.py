"""OpenTelemetry for every Conveyor process: OTLP export when `--otlp-endpoint` is given, W3C trace context in
HTTP headers and in gRPC metadata, so a request's router spans and its shards' spans share one trace id.

Without an endpoint the API's no-op tracer is used: spans cost next to nothing and nothing is exported.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind

TRACER_NAME = "conveyor"


def setup(service_name: str, endpoint: str | None) -> None:
    """Installs an OTLP/gRPC exporter for this process; a no-op without an endpoint."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)


def shutdown() -> None:
    """Flushes spans still buffered (the provider's shutdown exports them)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The context a `traceparent` (and `tracestate`) in headers or metadata describes."""
    return propagate.extract({k.lower(): v for k, v in carrier.items()})


def inject(span: Span | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying `span` (or the current span) to the next process."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


@contextmanager
def span(
    name: str,
    parent: Span | otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: list[Span] | None = None,
    **attributes,
) -> Iterator[Span]:
    """A span under `parent` (a span, a context, or the current span when None). With no tracer provider set
    (no `--otlp-endpoint`), the no-op tracer's span would be its parent's context again, unrecorded: the parent
    is yielded as it is, which saves what the no-op tracer takes to make it on the hot paths (a request's
    validation; every step, in the router and in each shard)."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        yield parent if isinstance(parent, Span) else trace.get_current_span(parent)
        return
    ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    span_links = [Link(s.get_span_context()) for s in links or []]
    with tracer().start_as_current_span(
        name, context=ctx, kind=kind, links=span_links, attributes=attributes
    ) as current:
        yield current
