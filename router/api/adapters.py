"""LoRA adapters loaded and unloaded live, in vLLM's shape: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (an admin key's), and what `/info` says of the adapters served."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.base import Schema

AdapterName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$",
        description="What requests call it: TGI's `parameters.adapter_id`, OpenAI's `model`, gRPC's `adapter_id`",
    ),
]


class LoadAdapterRequest(Schema):
    lora_name: AdapterName
    lora_path: Annotated[
        str,
        Field(
            min_length=1,
            max_length=4096,
            description="A directory on the shards' machines with PEFT's adapter_config.json and "
            "adapter_model.safetensors, or a Hub id (org/name), downloaded into the Hub's cache",
        ),
    ]


class UnloadAdapterRequest(Schema):
    lora_name: AdapterName


class AdapterInfo(TypedDict):
    name: str
    source: NotRequired[
        Annotated[str, Field(description="Where it was read from, a directory or a Hub id: shown to an admin key only")]
    ]
    rank: Annotated[int, Field(description="Its LoRA rank r")]
    weight_bytes: Annotated[int, Field(description="What its weights take on rank 0")]
    live: Annotated[bool, Field(description="Loaded through the API (false: --lora-adapters)")]


class AdapterLoaded(TypedDict):
    object: Literal["lora_adapter"]
    status: Literal["loaded"]
    adapter: AdapterInfo


class AdapterUnloaded(TypedDict):
    object: Literal["lora_adapter"]
    status: Literal["unloaded"]
    name: str
