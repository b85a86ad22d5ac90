"""The one configuration of a deployment: every flag declared once, parsed by one parser.

The launcher parses the command line into a `Config`, fills in what it decides (the model directory, the
shards' socket prefix) and hands every shard and the router the same flags (`to_argv`); each of them parses
them with this same parser. A flag added here reaches every process, with one help text and one default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("int8", "int4")
KV_CACHE_DTYPES = ("auto", "int8")  # shard/layers/kv_quant.py's CHOICES (a unit test holds them equal)
SCHEDULING = ("continuous", "static", "sequential")
DRAFT_POLICIES = ("measured", "fixed")
PLACEMENTS = ("cache-aware", "round-robin")  # router/core/placement.py's PLACEMENTS (a unit test holds them equal)
DEMO_SIZES = ("tiny", "small", "1b")
# vLLM's names (router/pipeline/tool_parsers/registry.py and reasoning.py hold the parsers; a unit test holds these
# lists to them).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json")
REASONING_PARSERS = ("deepseek_r1", "none", "qwen3")
# Never on a command line (where `ps` shows them): the launcher passes them on in the environment.
SECRET = {
    "api_key": "CONVEYOR_API_KEY",
    "shard_token": "CONVEYOR_SHARD_TOKEN",
    "metrics_key": "CONVEYOR_METRICS_KEY",
}


def flag(default: Any, help: str, **argparse_options: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_options})


@dataclass(frozen=True)
class Config:
    model_id: str = flag(
        "demo",
        "a local model directory, a Hugging Face Hub id (org/name, downloaded once into HF_HOME's cache), or "
        "'demo' (built on first use; 'demo-vision': an image-text one)",
    )
    revision: str | None = flag(None, "the Hub revision of --model-id: a branch, tag or commit (default: main)")
    served_model_name: str | None = flag(
        None, "the model's name in /info and the OpenAI API (default: --model-id as given)"
    )
    demo_size: str = flag("small", "size of the built-in demo model", choices=DEMO_SIZES)
    task: str | None = flag(
        None,
        "the prompt-only routes the deployment answers beside generation's: embed (/v1/embeddings, /embed: the "
        "checkpoint's pooling), rerank (/rerank, /v1/rerank: Qwen3-Reranker's yes/no score), generate (neither), or "
        "several comma-separated (default: embed for a sentence-transformers checkpoint, one with modules.json; "
        "else generate)",
    )
    # Shards
    num_shard: int = flag(1, "tensor-parallel ranks, one process each")
    dtype: str = flag(
        "auto",
        "weights and KV cache; auto: the checkpoint's dtype where the device computes it natively, else float32",
        choices=DTYPES,
    )
    quantize: str | None = flag(
        None,
        "quantization at load: int8 or int4, a float16 scale per 32 inputs (llama.cpp's q8_0, q4_0; the embedding "
        "int8 per row); both are widened to float against float inputs on every CPU kind, so answers do not "
        "depend on the CPU; CPU, needs the C++ kernels",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's element type: auto, the model's dtype; int8, each token's K and V per head as int8 with a "
        "float16 scale per 16 values (absmax / 127, as llama.cpp's q8_0 per 32), which holds ~3.6x the tokens of a "
        "float32 cache in the same memory (~1.8x bf16's) and is what decode attention reads",
        choices=KV_CACHE_DTYPES,
    )
    kv_offload_dir: str | None = flag(
        None,
        "a folder for the prefix cache's disk tier: every full prompt block is written there too, keyed by the "
        "model, the cache scope and its tokens, so that a restarted shard (or a replica on the same volume) reads a "
        "known prefix instead of prefilling it (each rank keeps its own files)",
    )
    kv_offload_max_gb: float = flag(10.0, "the disk tier's cap in GiB: the least recently used files go first")
    device: str = flag("auto", "auto takes one GPU per rank when GPUs are visible, else the CPU", choices=DEVICES)
    shard_uds_path: str | None = flag(
        None, "socket prefix for the shards; rank r listens on PREFIX-r (default: a private temp path)"
    )
    listen: str | None = flag(
        None,
        "shards listen on tcp://HOST:PORT instead of unix sockets, local rank i on PORT+i (HOST defaults to "
        "127.0.0.1; needs --shard-token)",
    )
    advertise_host: str | None = flag(
        None, "the host other nodes and the router reach this node's shards at (default: the --listen host)"
    )
    shard_address: str | None = flag(
        None,
        "router: rank 0's address (tcp://HOST:PORT or unix://PATH; the other ranks are discovered from it) or every "
        "rank's, comma-separated (default: the launcher's own shards)",
    )
    shard_token: str | None = flag(
        None,
        "shared secret the router sends and shards demand; required for shards on TCP (default: "
        "$CONVEYOR_SHARD_TOKEN; a single-node launcher makes one up)",
    )
    shard_tls_cert: str | None = flag(
        None, "PEM certificate chain: shards serve it, the router presents it as a client"
    )
    shard_tls_key: str | None = flag(None, "PEM private key of --shard-tls-cert")
    shard_tls_ca: str | None = flag(
        None, "PEM CA: the router verifies shards with it; shards given one demand client certificates (mutual TLS)"
    )
    # Several shard groups, one router (data parallel)
    replicas: int = flag(
        1,
        "shard groups on this machine, each a whole copy of the model on --num-shard ranks with its own KV pool and "
        "running batch; one router places each request on one of them (the cores are split between them)",
    )
    shard_groups: str | None = flag(
        None,
        "router: more shard groups to drive beside its own, ';'-separated, each as --shard-address names one (rank "
        "0's tcp://HOST:PORT or unix://PATH); they share --shard-token and the TLS flags",
    )
    placement: str = flag(
        "cache-aware",
        "which group a request joins: the one with the longest cached prefix of its prompt (unless it is busier than "
        "the least busy one by more than --placement-max-extra-load), or each group in turn",
        choices=PLACEMENTS,
    )
    placement_max_extra_load: int = flag(
        4096,
        "cache-aware placement: tokens of work ahead (prompts queued, tokens still to generate) the group holding a "
        "request's prefix may have beyond the least busy group's before the request goes to the least busy one",
    )
    # Several hosts, one model (like torchrun)
    nnodes: int = flag(1, "hosts the model spans; each runs a launcher with --num-shard ranks")
    node_rank: int = flag(0, "this host's place among --nnodes; node 0 also runs the router")
    master_addr: str = flag("127.0.0.1", "torch.distributed rendezvous address (node 0's, with --nnodes > 1)")
    master_port: int = flag(29500, "torch.distributed rendezvous port")
    # Front doors
    hostname: str = flag("127.0.0.1", "HTTP (and gRPC) listening address")
    port: int = flag(3000, "HTTP port")
    grpc_port: int | None = flag(None, "also serve the gRPC front door on this port")
    api_key: str | None = flag(
        None, "required as 'Authorization: Bearer KEY' on POST routes (default: $CONVEYOR_API_KEY)"
    )
    api_keys_file: str | None = flag(
        None,
        "JSON file of API keys, each with a name and optionally a weight (fair share), max_concurrent, top_priority "
        "and admin (docs/deployment.md: a shared server)",
    )
    metrics_key: str | None = flag(
        None,
        "GET /metrics then needs 'Authorization: Bearer KEY' (Prometheus' bearer auth) or an admin API key "
        "(default: $CONVEYOR_METRICS_KEY; unset, /metrics is open)",
    )
    payload_limit: int = flag(2_000_000, "largest request body in bytes (413 above)")
    max_concurrent_requests: int = flag(128, "requests in flight at once; more are refused with 429")
    http_idle_timeout: float = flag(
        15.0, "seconds a connection may take to send a request's headers, from opening or its last answer"
    )
    http_body_timeout: float = flag(30.0, "seconds a request's body may take to arrive after its headers (408)")
    max_connections_per_client: int = flag(256, "HTTP connections one client address may hold open at once")
    # Images (an image-text model's; router/pipeline/images.py and image_urls.py)
    max_images_per_request: int = flag(16, "images one request may carry (422 above)")
    max_image_bytes: int = flag(20_971_520, "an image's data in bytes, decoded or fetched (422 above)")
    max_image_pixels: int = flag(
        40_000_000, "an image's width x height as its header declares, checked before decoding (422 above)"
    )
    image_url_fetch: bool = flag(
        False,
        "fetch http(s) image URLs (off: only data URLs are taken), from the hosts --image-url-allowed-hosts names",
        action=argparse.BooleanOptionalAction,
    )
    image_url_allowed_hosts: str | None = flag(
        None,
        "comma-separated hosts image URLs may name: a name, .domain (it and every name under it), * (any), or an IP "
        "address or network; a host must resolve to public addresses only, unless the list names the address or "
        "its network (loopback, private, link-local are reached only so); redirects are checked the same way",
    )
    image_url_timeout: float = flag(10.0, "seconds a request's image URLs may take to arrive, all of them together")
    # Token limits (defaults from the model, see router/limits.py)
    max_input_tokens: int | None = flag(None, "longest prompt (default: max total - 1)")
    max_total_tokens: int | None = flag(None, "prompt + new tokens (default: the model's positions, at most 4096)")
    max_batch_prefill_tokens: int | None = flag(
        None, "prompt tokens read per step; longer prompts are read in chunks (default: max(4096, max input))"
    )
    max_batch_total_tokens: int | None = flag(
        None, "KV tokens all running requests may hold (default: sized from free memory at warmup)"
    )
    max_stop_sequences: int = flag(4, "stop sequences per request")
    max_top_n_tokens: int = flag(5, "most likely alternatives a request may ask for")
    # Batching
    max_batch_size: int | None = flag(None, "running requests at most (static scheduling: its batch size, default 32)")
    scheduling: str = flag(
        "continuous",
        "continuous batching, static batches run to completion (waiting for "
        "--max-batch-size requests or --static-batch-timeout), or sequential",
        choices=SCHEDULING,
    )
    static_batch_timeout: float = flag(1.0, "seconds a static batch waits to fill up")
    prefill_chunk_tokens: int | None = flag(None, "prompt tokens per step while streams are decoding (default: 512)")
    chat_special_tokens: bool = flag(
        False,
        "read special tokens written in chat messages (such as <|im_end|>) as control tokens, as the template's own "
        "are; off, they are text, so that a message cannot close its turn and open another (trusted callers only)",
        action=argparse.BooleanOptionalAction,
    )
    tool_call_parser: str | None = flag(
        None,
        "how the model writes tool calls (default: from its chat template's markers and config.json's model_type; "
        "hermes where neither names one)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = flag(
        None,
        "read a <think>...</think> block apart as reasoning_content (qwen3 and deepseek_r1 alike; none: off; "
        "default: on where the chat template writes <think>)",
        choices=REASONING_PARSERS,
    )
    max_decode_steps: int = flag(
        1,
        "decode steps the shards may run in one call while nobody waits to join (1: a call per step); an arrival "
        "or a cancellation ends the run after the step in progress",
    )
    speculate: int = flag(
        8,
        "speculative decoding: draft tokens (prompt lookup) each decoding request may have verified per step "
        "(0: off); greedy output and a seed's tokens are unchanged. Requests may ask for fewer (`speculate`)",
    )
    speculate_model: str | None = flag(
        None,
        "draft tokens from a second model instead of prompt lookup: a model directory or Hub id with the same "
        "vocabulary, or 'self' (the target's own checkpoint, best with --speculate-quantize)",
    )
    speculate_quantize: str | None = flag(
        None,
        "quantize the draft model at load (int8, int4: fewer bytes to read per drafted token)",
        choices=QUANTIZATIONS,
    )
    speculate_max_batch: int = flag(
        4, "speculate only while at most this many requests run (a larger batch is compute-bound: drafts cost)"
    )
    speculate_policy: str = flag(
        "measured",
        "measured: each request gets the drafts its acceptance so far pays for at the step costs timed at warmup "
        "(maybe none); fixed: every request may have all of --speculate at every step",
        choices=DRAFT_POLICIES,
    )
    prefix_caching: bool = flag(
        True, "share the KV blocks of common prompt prefixes", action=argparse.BooleanOptionalAction
    )
    # LoRA adapters
    lora_adapters: str | None = flag(
        None,
        "PEFT LoRA adapters served beside the base model, from the start: NAME=SOURCE[,NAME=SOURCE...], each source "
        "a directory (adapter_config.json, adapter_model.safetensors) or a Hub id; requests pick one by name",
    )
    max_loras: int = flag(4, "LoRA adapters resident at once (at start and loaded live)")
    # Process management
    startup_timeout: float = flag(600.0, "seconds to wait for shards and router to be ready")
    graceful_termination_timeout: float = flag(60.0, "seconds in-flight requests get to finish on shutdown")
    # Failure and recovery
    max_restarts: int = flag(10, "shard group restarts allowed within --restart-window; past them the launcher stops")
    restart_window: float = flag(600.0, "seconds over which --max-restarts is counted")
    max_request_retries: int = flag(
        2, "times a request is replayed after failed steps blamed on it; then it ends with an error"
    )
    shard_step_timeout: float | None = flag(
        None, "seconds a step may take before the shards count as hung and are restarted (default: sized from warmup)"
    )
    log_level: str | None = flag(None, "DEBUG, INFO, WARNING (default; or CONVEYOR_LOG_LEVEL)")
    otlp_endpoint: str | None = flag(None, "export OpenTelemetry spans of router and shards there (OTLP/gRPC)")

    @property
    def other_groups(self) -> list[str]:
        """--shard-groups as a list of addresses."""
        return [a.strip() for a in (self.shard_groups or "").split(";") if a.strip()]

    def to_argv(self) -> list[str]:
        """The flags that reproduce this configuration (secrets and defaults left out)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET or value == f.default:
                continue
            name = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(name if value else "--no-" + f.name.replace("_", "-"))
            else:
                argv += [name, str(value)]
        return argv


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    for f in fields(Config):
        options = dict(f.metadata)
        default = os.environ.get(SECRET[f.name]) if f.name in SECRET else f.default
        if options.get("action") is None and f.default is not MISSING:
            kind = _kind(f.type)
            if kind is not None:
                options["type"] = kind
        p.add_argument("--" + f.name.replace("_", "-"), default=default, **options)
    return p


def parse(argv: list[str] | None = None, description: str = "Conveyor") -> Config:
    return Config(**vars(parser(description).parse_args(argv)))


def _kind(annotation: str) -> type | None:
    """The argparse type of a field from its annotation (strings, with `from __future__ import annotations`)."""
    base = annotation.split("|")[0].strip()
    return {"int": int, "float": float, "str": None}.get(base)
