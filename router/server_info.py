"""What `/info` reports (HTTP and gRPC) and the dashboard shows: the model, the engine and the limits in force.

Its own module because every front door reads it and none of them owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor import __version__
from conveyor.router.api import tgi as api
from conveyor.router.limits import Limits


@dataclass(frozen=True)
class ServerInfo:
    """What `/info` reports: the model, the engine and the limits in force."""

    model_id: str
    model_dtype: str
    engine: str
    limits: Limits
    max_concurrent_requests: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    num_shard: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    weight_bytes: int = 0  # rank 0's
    quantize: str | None = None
    kv_cache_dtype: str = ""  # the shards' KV cache element type (int8 under --kv-cache-dtype int8)
    kv_offload_max_bytes: int = 0  # the prefix cache's disk tier's cap (--kv-offload-max-gb), 0 without one
    device: str = "cpu"  # the shards' device type (the dashboard shows it)

    def to_json(self) -> api.Info:
        return {
            "model_id": self.model_id,
            "model_dtype": self.model_dtype,
            "engine": self.engine,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_input_tokens": self.limits.max_input_tokens,
            "max_total_tokens": self.limits.max_total_tokens,
            "max_stop_sequences": self.limits.max_stop_sequences,
            "max_top_n_tokens": self.limits.max_top_n_tokens,
            "max_batch_prefill_tokens": self.max_batch_prefill_tokens,
            "max_batch_total_tokens": self.max_batch_total_tokens,
            "max_batch_size": self.max_batch_size,
            "num_shard": self.num_shard,
            "generation_defaults": self.generation_defaults,
            "weight_bytes": self.weight_bytes,
            "quantize": self.quantize,
            "kv_cache_dtype": self.kv_cache_dtype or self.model_dtype,
            "kv_offload_max_bytes": self.kv_offload_max_bytes,
            "router": "conveyor",
            "version": __version__,
            # TGI's fields, for its clients and dashboards (docs/migrating-from-tgi.md)
            "model_sha": None,
            "model_device_type": self.device,
            "model_pipeline_tag": "text-generation",
            "max_best_of": 1,
            "max_input_length": self.limits.max_input_tokens,
            "max_client_batch_size": 1,
            "validation_workers": 0,
            "waiting_served_ratio": None,
            "max_waiting_tokens": None,
            "sha": None,
            "docker_label": None,
        }
