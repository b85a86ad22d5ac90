"""Prometheus metrics of the router, served at `GET /metrics`. Names are prefixed `conveyor_`.

One registry per router process, so tests and several servers in one interpreter never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

# Latency buckets from 1 ms to ~2 min, about x1.6 apart: decode steps on CPU take tens to hundreds of ms, requests
# seconds.
LATENCY_BUCKETS = tuple(round(0.001 * 1.6**k, 6) for k in range(26))

OUTCOMES = ("success", "validation", "overloaded", "generation", "unavailable", "cancelled", "unauthorized")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("conveyor_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("conveyor_generated_tokens", "Tokens generated and sent", registry=r)
        self.queue_size = Gauge("conveyor_queue_size", "Requests waiting to join a batch", registry=r)
        self.batch_size = Gauge("conveyor_batch_current_size", "Requests in the running batch", registry=r)
        self.kv_blocks_used = Gauge("conveyor_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_blocks_total = Gauge("conveyor_kv_blocks_total", "KV blocks in the pool", registry=r)
        # The same for each shard group (--replicas, --shard-groups), and where the router placed requests.
        g = ["group"]
        self.group_queue_size = Gauge(
            "conveyor_group_queue_size", "Requests waiting, placed on the group", g, registry=r
        )
        self.group_batch_size = Gauge(
            "conveyor_group_batch_size", "Requests in the group's running batch", g, registry=r
        )
        self.group_kv_blocks_used = Gauge("conveyor_group_kv_blocks_used", "KV blocks held in the group", g, registry=r)
        self.group_kv_blocks_total = Gauge(
            "conveyor_group_kv_blocks_total", "KV blocks in the group's pool", g, registry=r
        )
        self.group_serving = Gauge(
            "conveyor_group_serving",
            "1 while requests are placed on the group; 0 while it recovers or drains",
            g,
            registry=r,
        )
        self.group_prefix_cache_queries = Counter(
            "conveyor_group_prefix_cache_queries", "Prompt tokens looked up in the group's prefix cache", g, registry=r
        )
        self.group_prefix_cache_hits = Counter(
            "conveyor_group_prefix_cache_hits", "Prompt tokens found in the group's prefix cache", g, registry=r
        )
        self.placements = Counter(
            "conveyor_placements",
            "Requests placed on a group, and why: prefix (its cached prefix), load (the least busy), round_robin, "
            "moved (its group failed or drained before it ran)",
            ["group", "reason"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "conveyor_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "conveyor_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_cache_disk_hits = Counter(
            "conveyor_prefix_cache_disk_hits",
            "Prompt tokens the shards read from the KV offload folder (--kv-offload-dir) instead of computing them",
            registry=r,
        )
        self.prefix_cache_disk_load = Histogram(
            "conveyor_prefix_cache_disk_load_seconds",
            "Time a step spent reading prompt blocks from the KV offload folder",
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.kv_offload_bytes = Gauge(
            "conveyor_kv_offload_bytes", "Bytes in the KV offload folder (a rank's, as of the last step)", registry=r
        )
        self.kv_offload_skipped = Gauge(
            "conveyor_kv_offload_skipped_files",
            "Block files a shard skipped as damaged or foreign since it started (a rank's)",
            registry=r,
        )
        self.preemptions = Counter(
            "conveyor_preemptions", "Running requests preempted for lack of KV blocks", registry=r
        )
        self.shard_restarts = Counter(
            "conveyor_shard_restarts", "Times the shards were lost and the router reconnected to them", registry=r
        )
        self.requests_replayed = Counter(
            "conveyor_requests_replayed", "Running requests put back in the queue after a failed step", registry=r
        )
        self.prefill_chunks = Counter(
            "conveyor_prefill_chunks", "Prompt chunks that left their prompt unfinished", registry=r
        )
        self.constrained_requests = Counter(
            "conveyor_constrained_requests", "Requests with structured output, by constraint kind", ["kind"], registry=r
        )
        self.grammar_compile = self._histogram(
            "conveyor_grammar_compile_duration_seconds", "Compiling a constraint not seen before (router validation)"
        )
        self.grammar_mask = self._histogram(
            "conveyor_grammar_mask_duration_seconds", "Computing and applying token masks in a step with constraints"
        )
        self.queue_time = self._histogram("conveyor_request_queue_duration_seconds", "Time from arrival to prefill")
        self.ttft = self._histogram("conveyor_time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = self._histogram("conveyor_inter_token_latency_seconds", "Time between two tokens of a stream")
        self.duration = self._histogram("conveyor_request_duration_seconds", "Time from arrival to the last token")
        # Per API key, by the key's name (never the key itself): a shared server's tenants side by side.
        self.key_requests = Counter(
            "conveyor_key_requests", "Requests by API key name and outcome", ["key", "outcome"], registry=r
        )
        self.adapter_requests = Counter(
            "conveyor_adapter_requests", "Requests admitted, by LoRA adapter name", ["adapter"], registry=r
        )
        self.adapter_generated_tokens = Counter(
            "conveyor_adapter_generated_tokens",
            "Tokens generated and sent, by LoRA adapter name",
            ["adapter"],
            registry=r,
        )
        self.key_generated_tokens = Counter(
            "conveyor_key_generated_tokens", "Tokens generated and sent, by API key name", ["key"], registry=r
        )
        self.key_in_flight = Gauge(
            "conveyor_key_in_flight", "Requests queued or running, by API key name", ["key"], registry=r
        )
        self.step = Histogram(
            "conveyor_batch_step_duration_seconds",
            "Prefill and decode steps, RPC included",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_runs = Counter(
            "conveyor_decode_runs", "Decode runs (several decode steps in one call to the shards)", registry=r
        )
        self.decode_runs_cut = Counter(
            "conveyor_decode_runs_cut",
            "Decode runs ended early by an arrival that could join or a cancellation",
            registry=r,
        )
        self.speculative_drafted = Counter(
            "conveyor_speculative_drafted_tokens", "Draft tokens verified (speculative decoding)", registry=r
        )
        self.speculative_accepted = Counter(
            "conveyor_speculative_accepted_tokens",
            "Draft tokens accepted: each is a token made without a step of its own",
            registry=r,
        )
        self.speculative_steps = Counter(
            "conveyor_speculative_steps", "Request steps that verified at least one draft token", registry=r
        )
        self.speculative_offered = Counter(
            "conveyor_speculative_offered_tokens",
            "Draft tokens the router let requests have verified: those it judged to pay for their rows",
            registry=r,
        )
        self.speculative_acceptance = Gauge(
            "conveyor_speculative_acceptance",
            "Per-position draft acceptance, pooled over recent steps, that new requests start from",
            ["group"],
            registry=r,
        )
        self.speculative_step_cost = Gauge(
            "conveyor_speculative_step_cost_ratio",
            "A decode step of one request at this many rows (a verify step) over a one-row step, timed at warmup",
            ["group", "rows"],
            registry=r,
        )
        self.shard_step = Histogram(
            "conveyor_shard_step_duration_seconds",
            "A step inside the slowest shard: forward, sampling and detokenizing",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tgi = TgiMetrics(self)

    def _histogram(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, documentation, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TgiMetrics:
    """TGI's metric names beside Conveyor's (docs/migrating-from-tgi.md), so that TGI's Grafana dashboard keeps
    working. Histograms and gauges are TGI's types, in seconds as TGI's; the ones Conveyor measures already are read
    from its own instruments at scrape time, the rest are fed where the router sees the event. TGI's counters are
    exposed under their bare names (TGI's exporter adds no `_total`), which prometheus_client only writes as untyped.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        r = metrics.registry
        m = ("method",)
        self.input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.max_new_tokens = Histogram(
            "tgi_request_max_new_tokens", "max_new_tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.skipped_tokens = Histogram(
            "tgi_request_skipped_tokens",
            "Prompt tokens per request the prefix cache served (not computed)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.mean_time_per_token = metrics._histogram(
            "tgi_request_mean_time_per_token_duration", "Request time after the first token, per generated token"
        )
        self.inference_duration = metrics._histogram(
            "tgi_request_inference_duration", "Time from joining a batch to the last token"
        )
        self.forward = metrics._histogram("tgi_batch_forward_duration", "A step inside the slowest shard", m)
        self.decode = metrics._histogram("tgi_batch_decode_duration", "Applying a step's tokens in the router", m)
        self.filter = metrics._histogram("tgi_batch_filter_duration", "Dropping finished requests from the batch", m)
        self.concat_duration = metrics._histogram(
            "tgi_batch_concat_duration", "Prefill steps that joined requests to a running batch", m
        )
        self.next_size = Histogram(
            "tgi_batch_next_size", "Requests admitted by a prefill step", buckets=TOKEN_BUCKETS, registry=r
        )
        self.current_max_tokens = Gauge(
            "tgi_batch_current_max_tokens", "KV tokens held by the running requests", registry=r
        )
        for method in ("prefill", "decode"):
            for histogram in (self.forward, self.decode, self.filter, self.concat_duration):
                histogram.labels(method)
        self._counts = {"concat": 0.0}
        r.register(_TgiMirror(self))

    def finished(
        self,
        prompt_tokens: int,
        generated: int,
        max_new_tokens: int,
        cached: int,
        first: float,
        batched: float | None,
        now: float,
    ) -> None:
        """A request's end, successful: its sizes and times as TGI's histograms hold them."""
        self.input_length.observe(prompt_tokens)
        self.generated_tokens.observe(generated)
        self.max_new_tokens.observe(max_new_tokens)
        self.skipped_tokens.observe(cached)
        if generated > 1:
            self.mean_time_per_token.observe((now - first) / (generated - 1))
        if batched is not None:
            self.inference_duration.observe(now - batched)

    def step(self, method: str, admitted: int, joined_running: bool, seconds: float) -> None:
        if admitted:
            self.next_size.observe(admitted)
        if joined_running:
            self._counts["concat"] += 1
            self.concat_duration.labels(method).observe(seconds)


TOKEN_BUCKETS = tuple(2**k for k in range(18))


class _TgiMirror:
    """TGI's names for what Conveyor's own instruments measure, read from them at each scrape."""

    def __init__(self, tgi: TgiMetrics) -> None:
        self.tgi = tgi

    def describe(self) -> list:
        return []

    def collect(self):  # type: ignore[no-untyped-def]
        m = self.tgi.metrics
        outcomes = {outcome: m.requests.labels(outcome)._value.get() for outcome in OUTCOMES}

        def plain(name: str, doc: str, kind: str, samples: list[tuple[dict[str, str], float]]) -> Metric:
            family = Metric(name, doc, kind)
            for labels, value in samples:
                family.add_sample(name, labels, value)
            return family

        yield plain("tgi_request_count", "Requests ended", "unknown", [({}, sum(outcomes.values()))])
        yield plain("tgi_request_success", "Requests that succeeded", "unknown", [({}, outcomes["success"])])
        failures = [({"err": k}, v) for k, v in outcomes.items() if k != "success"]
        yield plain("tgi_request_failure", "Requests that failed, by error type", "unknown", failures)
        yield plain(
            "tgi_batch_concat",
            "Prefill steps that joined a running batch",
            "unknown",
            [({"reason": "backpressure"}, self.tgi._counts["concat"])],
        )
        steps = {s.labels["method"]: s.value for f in m.step.collect() for s in f.samples if s.name.endswith("_count")}
        counts = [({"method": k}, v) for k, v in steps.items() if k in ("prefill", "decode")]
        yield plain("tgi_batch_inference_count", "Steps by method", "unknown", counts)
        yield plain(
            "tgi_batch_inference_success", "Steps by method (a failed step restarts the shards)", "unknown", counts
        )
        yield plain("tgi_queue_size", "Requests waiting", "gauge", [({}, m.queue_size._value.get())])
        yield plain("tgi_batch_current_size", "Requests running", "gauge", [({}, m.batch_size._value.get())])
        for name, source in (
            ("tgi_request_duration", m.duration),
            ("tgi_request_queue_duration", m.queue_time),
            ("tgi_batch_inference_duration", m.step),
        ):
            for family in source.collect():
                renamed = Metric(name, family.documentation, "histogram")
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    suffix = s.name[len(family.name) :]
                    renamed.add_sample(name + suffix, s.labels, s.value)
                yield renamed
