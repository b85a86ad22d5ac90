from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("dtype", "device_type", "block_size", "engine", "model_type", "max_position_embeddings", "world_size", "pid", "rank", "instance", "weight_bytes", "quantize", "adapters", "max_loras", "kv_cache_dtype", "kv_offload_max_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    device_type: str
    block_size: int
    engine: str
    model_type: str
    max_position_embeddings: int
    world_size: int
    pid: int
    rank: int
    instance: str
    weight_bytes: int
    quantize: str
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    max_loras: int
    kv_cache_dtype: str
    kv_offload_max_bytes: int
    def __init__(self, dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., block_size: _Optional[int] = ..., engine: _Optional[str] = ..., model_type: _Optional[str] = ..., max_position_embeddings: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., instance: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., quantize: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., max_loras: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_offload_max_bytes: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "source", "rank", "weight_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    rank: int
    weight_bytes: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., rank: _Optional[int] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class StoppingParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "input_ids", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "blocks", "cache_len", "chunk_len", "resumed_tokens", "grammar", "adapter", "cache_scope", "pooling", "images")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    id: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    parameters: SamplingParameters
    stopping_parameters: StoppingParameters
    prefill_logprobs: bool
    top_n_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    chunk_len: int
    resumed_tokens: int
    grammar: str
    adapter: str
    cache_scope: str
    pooling: Pooling
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, id: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., parameters: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., chunk_len: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., adapter: _Optional[str] = ..., cache_scope: _Optional[str] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("offset", "length", "pixel_values", "shape")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    pixel_values: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., pixel_values: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("embed", "score")
    class Embed(_message.Message):
        __slots__ = ("mode", "normalize")
        MODE_FIELD_NUMBER: _ClassVar[int]
        NORMALIZE_FIELD_NUMBER: _ClassVar[int]
        mode: str
        normalize: bool
        def __init__(self, mode: _Optional[str] = ..., normalize: _Optional[bool] = ...) -> None: ...
    class Score(_message.Message):
        __slots__ = ("yes_token_id", "no_token_id")
        YES_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        NO_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        yes_token_id: int
        no_token_id: int
        def __init__(self, yes_token_id: _Optional[int] = ..., no_token_id: _Optional[int] = ...) -> None: ...
    EMBED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    embed: Pooling.Embed
    score: Pooling.Score
    def __init__(self, embed: _Optional[_Union[Pooling.Embed, _Mapping]] = ..., score: _Optional[_Union[Pooling.Score, _Mapping]] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "new_blocks", "chunk_len", "speculate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    new_blocks: _containers.RepeatedScalarFieldContainer[int]
    chunk_len: int
    speculate: int
    def __init__(self, request_id: _Optional[int] = ..., new_blocks: _Optional[_Iterable[int]] = ..., chunk_len: _Optional[int] = ..., speculate: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests", "size")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    size: int
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., size: _Optional[int] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids", "size")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    size: int
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "finished", "top_tokens", "drafted", "disk_cached_tokens", "embedding", "score")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    finished: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    drafted: int
    disk_cached_tokens: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    score: float
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finished: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., drafted: _Optional[int] = ..., disk_cached_tokens: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ..., score: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("total_ns", "mask_ns", "disk_loaded_tokens", "disk_load_ns", "disk_bytes", "disk_skipped_files")
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    MASK_NS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_SKIPPED_FILES_FIELD_NUMBER: _ClassVar[int]
    total_ns: int
    mask_ns: int
    disk_loaded_tokens: int
    disk_load_ns: int
    disk_bytes: int
    disk_skipped_files: int
    def __init__(self, total_ns: _Optional[int] = ..., mask_ns: _Optional[int] = ..., disk_loaded_tokens: _Optional[int] = ..., disk_load_ns: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_skipped_files: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch", "cached_batch", "updates")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHED_BATCH_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    cached_batch: CachedBatch
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., cached_batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "timings")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    timings: Timings
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches", "updates")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ...) -> None: ...

class DecodeRunRequest(_message.Message):
    __slots__ = ("decode", "max_steps", "stop")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    max_steps: int
    stop: bool
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., max_steps: _Optional[int] = ..., stop: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "timings")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    batch: CachedBatch
    timings: Timings
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("prefill", "decode", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillRequest
    decode: DecodeRequest
    trace: _containers.ScalarMap[str, str]
    def __init__(self, prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("prefill", "decode", "error")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillResponse
    decode: DecodeResponse
    error: StepError
    def __init__(self, prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., decode: _Optional[_Union[DecodeResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class FilterBatchRequest(_message.Message):
    __slots__ = ("batch_id", "request_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FilterBatchResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: CachedBatch
    def __init__(self, batch: _Optional[_Union[CachedBatch, _Mapping]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("batch", "max_batch_total_tokens", "step_timeout", "calibrate_rows")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_ROWS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    max_batch_total_tokens: int
    step_timeout: float
    calibrate_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., max_batch_total_tokens: _Optional[int] = ..., step_timeout: _Optional[float] = ..., calibrate_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens", "step_timeout", "step_seconds", "draft_step_seconds")
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    step_timeout: float
    step_seconds: _containers.RepeatedScalarFieldContainer[float]
    draft_step_seconds: float
    def __init__(self, max_supported_total_tokens: _Optional[int] = ..., step_timeout: _Optional[float] = ..., step_seconds: _Optional[_Iterable[float]] = ..., draft_step_seconds: _Optional[float] = ...) -> None: ...
