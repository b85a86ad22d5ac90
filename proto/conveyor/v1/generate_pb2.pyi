from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Parameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "max_new_tokens", "stop", "ignore_eos", "details", "decoder_input_details", "return_full_text", "top_n_tokens", "truncate", "constraint", "min_p", "priority", "cache_salt", "speculate", "adapter_id")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    DECODER_INPUT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FULL_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    top_n_tokens: int
    truncate: int
    constraint: Constraint
    min_p: float
    priority: int
    cache_salt: str
    speculate: int
    adapter_id: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., details: _Optional[bool] = ..., decoder_input_details: _Optional[bool] = ..., return_full_text: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., truncate: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., min_p: _Optional[float] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., speculate: _Optional[int] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "parameters")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    parameters: Parameters
    def __init__(self, inputs: _Optional[str] = ..., parameters: _Optional[_Union[Parameters, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ...) -> None: ...

class TopTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class Details(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "input_length", "drafted_tokens", "accepted_tokens", "prefill_cached_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[Token]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    input_length: int
    drafted_tokens: int
    accepted_tokens: int
    prefill_cached_tokens: int
    def __init__(self, finish_reason: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., input_length: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("generated_text", "details")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    details: Details
    def __init__(self, generated_text: _Optional[str] = ..., details: _Optional[_Union[Details, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("index", "token", "top_tokens", "generated_text", "details")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: Token
    top_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_text: str
    details: Details
    def __init__(self, index: _Optional[int] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_text: _Optional[str] = ..., details: _Optional[_Union[Details, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    def __init__(self, inputs: _Optional[str] = ...) -> None: ...

class TokenOffset(_message.Message):
    __slots__ = ("id", "text", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenOffset]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenOffset, _Mapping]]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("model_id", "model_dtype", "engine", "max_input_tokens", "max_total_tokens", "max_concurrent_requests", "max_batch_total_tokens", "num_shard", "version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_dtype: str
    engine: str
    max_input_tokens: int
    max_total_tokens: int
    max_concurrent_requests: int
    max_batch_total_tokens: int
    num_shard: int
    version: str
    def __init__(self, model_id: _Optional[str] = ..., model_dtype: _Optional[str] = ..., engine: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_batch_total_tokens: _Optional[int] = ..., num_shard: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("id", "key", "state", "priority", "prompt_tokens", "generated_tokens", "max_new_tokens", "age_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    key: str
    state: str
    priority: int
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int
    age_s: float
    def __init__(self, id: _Optional[str] = ..., key: _Optional[str] = ..., state: _Optional[str] = ..., priority: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestState]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ...) -> None: ...

class CancelRequestRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelRequestResponse(_message.Message):
    __slots__ = ("id", "status")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: str
    def __init__(self, id: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...
