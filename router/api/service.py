"""Conveyor's own routes for running a shared server: the requests in flight (`GET /v1/requests`,
`DELETE /v1/requests/{id}`) and the dashboard's figures (`GET /dashboard/state`, with each LoRA adapter's use)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from typing_extensions import TypedDict


class RequestState(TypedDict):
    id: Annotated[str, Field(description="The request's X-Request-Id: the client's own if it sent a safe one")]
    key: Annotated[str, Field(description="The name of the API key that made it")]
    state: Literal["queued", "running"]
    priority: Annotated[int, Field(description="Lower is served first (after the key's top_priority)")]
    prompt_tokens: int
    generated_tokens: Annotated[int, Field(description="Tokens generated so far")]
    max_new_tokens: int
    age_s: Annotated[float, Field(description="Seconds since it arrived")]


class RequestList(TypedDict):
    object: Literal["list"]
    data: Annotated[
        list[RequestState],
        Field(description="The caller's requests queued or running, oldest first (every key's for an admin key)"),
    ]


class Cancelled(TypedDict):
    id: str
    status: Literal["cancelled"]


class Percentiles(TypedDict):
    p50: Annotated[float | None, Field(description="Seconds; null when the last minute had no sample")]
    p90: float | None
    p99: float | None


class KvBlocks(TypedDict):
    total: Annotated[int, Field(description="Blocks in the KV pool")]
    used: Annotated[int, Field(description="Held by requests queued or running")]
    cached: Annotated[int, Field(description="Held by no request, kept for prefix-cache hits; reclaimed when needed")]
    free: Annotated[int, Field(description="Empty; used + cached + free = total")]
    dtype: Annotated[str, Field(description="What a block's K and V are stored as: the model's dtype, or int8")]
    disk_bytes: Annotated[int, Field(description="The prefix cache's disk tier (--kv-offload-dir): bytes in it")]


class GroupState(TypedDict):
    index: Annotated[int, Field(description="The shard group's place: 0 is --shard-address, then --shard-groups")]
    status: Annotated[
        Literal["serving", "recovering", "draining"],
        Field(description="serving: requests are placed here; recovering: its shards restart; draining: taken out"),
    ]
    num_shard: Annotated[int, Field(description="Its tensor-parallel ranks")]
    running: Annotated[int, Field(description="Requests in its running batch")]
    waiting: Annotated[int, Field(description="Requests placed on it and waiting to join")]
    kv_blocks_total: int
    kv_blocks_free: Annotated[int, Field(description="Blocks it could hand out now (cached, unread ones count)")]
    prefix_cache_hit_tokens: Annotated[int, Field(description="Prompt tokens found in its prefix cache, since start")]
    prefix_cache_query_tokens: Annotated[int, Field(description="Prompt tokens looked up there, since start")]
    placed: Annotated[int, Field(description="Requests the router placed on it, since start")]


class Caller(TypedDict):
    name: Annotated[str, Field(description="The name of the API key that asked")]
    admin: Annotated[bool, Field(description="Whether it sees and may cancel every key's requests")]


class Drafts(TypedDict):
    drafted: Annotated[int, Field(description="Draft tokens verified since the start (speculative decoding)")]
    accepted: Annotated[int, Field(description="...of which accepted: tokens made without a step of their own")]


class AdapterUse(TypedDict):
    requests: Annotated[int, Field(description="Requests admitted since the start")]
    tokens: Annotated[int, Field(description="Tokens generated and sent since the start")]


class DashboardState(TypedDict):
    model: str
    dtype: str
    device: Annotated[str, Field(description="The shards' device type (cpu, cuda)")]
    engine: str
    num_shard: int
    status: Annotated[Literal["serving", "recovering"], Field(description="recovering: the shards are restarting")]
    restarts: Annotated[int, Field(description="Times the shards were lost and reconnected to, since the start")]
    speculative: Drafts
    adapters: Annotated[dict[str, AdapterUse], Field(description="Each LoRA adapter served, by name")]
    queue_by_priority: Annotated[dict[str, int], Field(description="Requests waiting, by priority")]
    queue_length: int
    batch_size: Annotated[int, Field(description="Requests in the running batch")]
    kv: KvBlocks
    groups: Annotated[list[GroupState], Field(description="Each shard group the router drives")]
    tokens_per_s: Annotated[float, Field(description="Tokens sent per second, over the last 5 seconds")]
    ttft: Annotated[Percentiles, Field(description="Time to first token over the last minute")]
    itl: Annotated[Percentiles, Field(description="Time between two tokens of a stream over the last minute")]
    requests: Annotated[
        list[RequestState],
        Field(description="The caller's requests running or queued, oldest first (every key's for an admin key)"),
    ]
    caller: Caller
    time: Annotated[float, Field(description="The server's clock, seconds since the Unix epoch")]
