"""TGI's API: `/generate`, `/generate_stream`, `/` and `/tokenize`, their answers, and `/info` and `/health`.

`Sampling` holds the sampling parameters under TGI's names, which are also the router's and the shards' names:
a field added here reaches the shards (`transport.wire.sampling_pb` copies each one the shard proto has), the gRPC
front door (`grpc_server.parameters_from_pb` reads each one its proto has) and, through `SharedSampling`, the
OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.adapters import AdapterInfo
from conveyor.router.api.base import (
    UINT32_MAX,
    Penalty,
    Probability,
    Schema,
    Seed,
    Text,
    limited,
    refused,
)
from conveyor.router.api.constraints import TgiGrammar
from conveyor.router.api.service import GroupState

# Sampling floats travel to the shards as float32, where a positive value below ~1e-45 is 0, which the shard
# reads as "unset" (1.0): `temperature: 1e-50` sampled at temperature 1, `top_p: 1e-50` from the whole
# vocabulary. So smaller values of temperature, top_p, typical_p and repetition_penalty are taken as this floor,
# where the shard already picks the most likely token (it clamps temperature there itself).
MIN_POSITIVE = 1e-6
# `temperature: 1e308` is no request anyone means, and on the float32 wire it is infinity (NaN logits).
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


def _floor(value: float) -> float:
    return max(value, MIN_POSITIVE)


class _Warper:
    """Marks a sampling field that reshapes the distribution: set away from its default, it implies sampling
    (TGI's rule), greedy decoding drops it, and a model's generation_config.json default applies only when the
    model samples."""


WARPER = _Warper()
FloorProbability = Annotated[Probability, AfterValidator(_floor)]


class SharedSampling(Schema):
    """The sampling fields TGI's and OpenAI's routes both take, under one name and one rule (OpenAI's own
    temperature differs: 0 there means greedy)."""

    top_k: Annotated[int, Field(ge=0, le=UINT32_MAX, description="Only the k most likely tokens (0: off)"), WARPER] = 0
    top_p: Annotated[FloorProbability, Field(description="Nucleus sampling"), WARPER] = 1.0
    typical_p: Annotated[FloorProbability, Field(description="Locally typical sampling"), WARPER] = 1.0
    min_p: Annotated[
        float,
        Field(ge=0.0, le=1.0, description="Drops tokens less likely than min_p times the most likely one (0: off)"),
        WARPER,
    ] = 0.0
    seed: Annotated[Seed, Field(description="A sampling request without one gets one, which its details report")] = None  # type: ignore[assignment]
    repetition_penalty: Annotated[
        float,
        Field(gt=0.0, le=MAX_REPETITION_PENALTY, description="CTRL's: > 1 discourages repeats"),
        AfterValidator(_floor),
    ] = 1.0
    frequency_penalty: Annotated[Penalty, Field(description="OpenAI's: minus penalty * times generated")] = 0.0
    presence_penalty: Annotated[Penalty, Field(description="OpenAI's: minus penalty if generated at all")] = 0.0


class Sampling(SharedSampling):
    """TGI's sampling parameters: what the shards get, under the same names."""

    temperature: Annotated[float, Field(gt=0.0, le=MAX_TEMPERATURE), AfterValidator(_floor), WARPER] = 1.0
    do_sample: bool = False

    @property
    def samples(self) -> bool:
        """TGI's rule: any warper that reshapes the distribution implies sampling from it, not argmax."""
        return self.do_sample or any(getattr(self, name) != default for name, default in WARPERS.items())


WARPERS: dict[str, Any] = {
    name: info.default for name, info in Sampling.model_fields.items() if WARPER in info.metadata
}


MAX_SPECULATE = 16  # draft tokens a request may ask to verify per step (the server's --speculate bounds it)


class Serving(Schema):
    """How a request is served, on every front door: where it waits, whose cached prompt blocks it may reuse, and
    how far it may speculate."""

    priority: Annotated[
        int,
        Field(
            ge=-(2**31),
            le=2**31 - 1,
            description="Lower is served first (vLLM's convention): the queue admits the lowest (priority, "
            "arrival), and when KV runs out the highest value is preempted first. An API key's top_priority "
            "bounds it: a more urgent value is served at the key's",
        ),
    ] = 0
    cache_salt: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=256,
            description="Cached prompt blocks are shared only among requests of the same API key; with a salt, "
            "only among requests with the same salt (of any key that knows it): a secret that lets separate users "
            "of one key keep their prompts apart, or keys that agree share theirs (vLLM's cache_salt)",
        ),
    ] = None
    speculate: Annotated[
        int | None,
        Field(
            ge=0,
            le=MAX_SPECULATE,
            description="Speculative decoding: the most draft tokens verified per step for this request, within the "
            "server's --speculate (0: off; default: the server's). Greedy output is unchanged, and sampled output "
            "keeps its distribution and, with a seed, its tokens",
        ),
    ] = None


class GenerateParameters(Sampling, Serving):
    max_new_tokens: Annotated[
        int, Field(ge=1, description="Default: what the total token limit leaves"), limited("max_total_tokens", 1)
    ] = None  # type: ignore[assignment]
    stop: Annotated[list[Text], limited("max_stop_sequences", description="Stop sequences (--max-stop-sequences)")] = []
    truncate: Annotated[int, Field(ge=1, description="Keep the last n prompt tokens"), limited("max_input_tokens")] = (
        None  # type: ignore[assignment]
    )
    details: bool = False
    decoder_input_details: Annotated[bool, Field(description="Prompt log-probabilities; not with streaming")] = False
    return_full_text: bool = False
    top_n_tokens: Annotated[int, Field(ge=0), limited("max_top_n_tokens", description="Alternatives per token")] = 0
    ignore_eos: bool = False
    grammar: TgiGrammar | None = None
    adapter_id: Annotated[
        Text, Field(description="A LoRA adapter the server serves, by name (/v1/models lists them); unset: the base")
    ] = None  # type: ignore[assignment]
    # TGI's parameters Conveyor does not implement.
    best_of: refused(1, why="Conveyor has no best-of sampling") = None
    watermark: refused(False, why="Conveyor does not watermark") = None


class GenerateRequest(Schema):
    inputs: Annotated[Text, Field(description="The prompt (its token limits are the server's: /info)")]
    parameters: Annotated[GenerateParameters, Field(default_factory=GenerateParameters)]  # a default is deep-copied
    stream: Annotated[bool, Field(description="On `/`: server-sent events")] = False  # huggingface_hub sends it


class PlainGenerateRequest(GenerateRequest):
    """`/generate`'s body: `stream: true` is refused rather than answered in one piece (stream at /generate_stream)."""

    stream: Annotated[Literal[False], Field(description="Only false here: /generate_stream streams")] = False


# --- answers ---------------------------------------------------------------------------------------------------


class Error(TypedDict):
    error: str
    error_type: str


class Token(TypedDict):
    id: int
    text: str
    logprob: Annotated[float | None, Field(description="null where there is none (-inf, or the first prompt token)")]
    special: NotRequired[bool]


FinishReason = Literal["length", "eos_token", "stop_sequence"]


class Speculative(TypedDict, total=False):
    """Speculative decoding's share of a request, when it had drafts verified."""

    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float


class CachedPrefill(TypedDict, total=False):
    """The prefix cache's share of the prompt, when it served any (a Conveyor field: absent means 0, so that an
    answer without a cache hit has TGI's shape exactly)."""

    prefill_cached_tokens: Annotated[
        int,
        Field(
            description="Prompt tokens whose KV came from the prefix cache (memory or disk tier) instead of being "
            "computed: blocks an earlier prompt of the same key or cache_salt left (OpenAI's cached_tokens); "
            "absent when none"
        ),
    ]


class Details(Speculative, CachedPrefill):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[Token]
    tokens: list[Token]
    top_tokens: NotRequired[list[list[Token]]]


class GenerateResponse(TypedDict):
    generated_text: str
    details: NotRequired[Details]


class StreamDetails(Speculative, CachedPrefill):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamEvent(TypedDict):
    """One `data:` line per token; the last has generated_text (and details when asked). A stream that fails
    after it started ends with an `Error` event instead."""

    index: int
    token: Token
    top_tokens: NotRequired[list[Token]]
    generated_text: str | None
    details: StreamDetails | None


class TokenOffset(TypedDict):
    id: int
    text: str
    start: int
    stop: int


class Info(TypedDict):
    model_id: str
    model_dtype: str
    engine: str
    max_concurrent_requests: int
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    num_shard: int
    generation_defaults: Annotated[
        dict[str, Any],
        Field(description="The model's generation_config.json sampling, for what a request leaves unset"),
    ]
    weight_bytes: Annotated[int, Field(description="Rank 0's weights in memory, as loaded")]
    quantize: Annotated[str | None, Field(description="Weight quantization (--quantize), or null")]
    kv_cache_dtype: Annotated[
        str, Field(description="The KV cache's element type: the model's dtype, or int8 (--kv-cache-dtype int8)")
    ]
    kv_offload_max_bytes: Annotated[
        int, Field(description="The prefix cache's disk tier (--kv-offload-dir): its cap in bytes, 0 without one")
    ]
    router: str
    version: str
    model_sha: Annotated[str | None, Field(description="TGI's: the checkpoint's commit (null: not tracked)")]
    model_device_type: Annotated[str, Field(description="TGI's: the shards' device type")]
    model_pipeline_tag: Annotated[str, Field(description="TGI's: text-generation")]
    max_best_of: Annotated[int, Field(description="TGI's: 1, best_of is not supported")]
    max_input_length: Annotated[int, Field(description="TGI's old name of max_input_tokens")]
    max_client_batch_size: Annotated[int, Field(description="TGI's: one input per request")]
    validation_workers: Annotated[int, Field(description="TGI's: 0, validation runs on the router's loop")]
    waiting_served_ratio: Annotated[float | None, Field(description="TGI's: null, not a Conveyor setting")]
    max_waiting_tokens: Annotated[int | None, Field(description="TGI's: null, not a Conveyor setting")]
    sha: Annotated[str | None, Field(description="TGI's: the server's commit (null)")]
    docker_label: Annotated[str | None, Field(description="TGI's: the image's label (null)")]
    kv_blocks_free: NotRequired[int]
    kv_blocks_total: NotRequired[int]
    placement: Annotated[
        NotRequired[str],
        Field(description="How a request's shard group is chosen (--placement)"),
    ]
    groups: Annotated[NotRequired[list[GroupState]], Field(description="Each shard group the router drives")]
    lora_adapters: Annotated[list[AdapterInfo], Field(description="The LoRA adapters served now")]
    max_loras: Annotated[int, Field(description="How many may be resident at once (--max-loras)")]


class Health(TypedDict):
    status: Literal["ok"]
