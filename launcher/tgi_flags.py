"""`text-generation-launcher`'s flags and environment variables, read as Conveyor's.

TGI's images are configured through environment variables (MODEL_ID, NUM_SHARD, PORT, ...) and its command line;
a deployment that moves to Conveyor by changing its image keeps both. This module is the one table of what each
TGI flag becomes here: most share Conveyor's name and meaning, a few are renamed, and the rest have no equivalent
and stop the launcher with one line naming them, rather than being ignored. An explicit flag beats its
environment variable, as in TGI. docs/migrating-from-tgi.md is the same table for people.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# TGI flags Conveyor has under the same name and meaning; their environment variable is the upper-case name.
SAME = (
    "model_id",
    "revision",
    "num_shard",
    "quantize",
    "speculate",
    "dtype",
    "kv_cache_dtype",
    "max_concurrent_requests",
    "max_stop_sequences",
    "max_top_n_tokens",
    "max_input_tokens",
    "max_total_tokens",
    "max_batch_prefill_tokens",
    "max_batch_total_tokens",
    "max_batch_size",
    "port",
    "shard_uds_path",
    "master_addr",
    "master_port",
    "otlp_endpoint",
    "api_key",
    "lora_adapters",
    "payload_limit",
    "graceful_termination_timeout",
    "served_model_name",
)
# TGI's name -> Conveyor's.
RENAMED = {"max_input_length": "max_input_tokens"}
# TGI flags that set an environment variable the Hugging Face Hub client reads.
TO_ENVIRONMENT = {"huggingface_hub_cache": "HF_HUB_CACHE"}
# TGI flags with no equivalent here: refused, with the reason.
REFUSED = {
    "validation_workers": "requests are validated on the router's event loop, there are no validation workers",
    "sharded": "use --num-shard",
    "max_best_of": "best_of is not supported",
    "waiting_served_ratio": "the scheduler admits waiting requests at every step",
    "max_waiting_tokens": "the scheduler admits waiting requests at every step",
    "cuda_graphs": "CUDA graphs are not configurable",
    "prometheus_port": "/metrics is served on --port",
    "weights_cache_override": "give --model-id a local directory",
    "disable_custom_kernels": "the kernels fall back on their own",
    "cuda_memory_fraction": "the KV pool is sized from free memory, or --max-batch-total-tokens",
    "rope_scaling": "RoPE scaling is read from the checkpoint's config.json",
    "rope_factor": "RoPE scaling is read from the checkpoint's config.json",
    "json_output": "logs are text",
    "otlp_service_name": "the service names are conveyor-router and conveyor-shard",
    "cors_allow_origin": "CORS headers are not served",
    "watermark_gamma": "watermarking is not supported",
    "watermark_delta": "watermarking is not supported",
    "ngrok": "ngrok tunnels are not supported",
    "ngrok_authtoken": "ngrok tunnels are not supported",
    "ngrok_edge": "ngrok tunnels are not supported",
    "tokenizer_config_path": "the tokenizer config is read from the model directory",
    "disable_grammar_support": "grammars are always on",
    "env": "not supported",
    "max_client_batch_size": "a request carries one input",
    "usage_stats": "Conveyor sends no usage statistics",
    "disable_usage_stats": "Conveyor sends no usage statistics",
    "enable_prefill_logprobs": "prompt log-probabilities are not supported",
    "trust_remote_code": "Conveyor runs its own model code, never the checkpoint's",
}
# HOSTNAME is exported in every container (the container's id), so TGI's HOSTNAME variable is not read: --hostname
# is the same flag as TGI's (default 127.0.0.1 here). ENV is a shell's variable, not refused when set.
NOT_FROM_ENVIRONMENT = ("env",)
# Values TGI accepts that Conveyor cannot honour.
REFUSED_VALUES = {
    "quantize": (
        "awq",
        "compressed-tensors",
        "eetq",
        "exl2",
        "gptq",
        "marlin",
        "bitsandbytes",
        "bitsandbytes-nf4",
        "bitsandbytes-fp4",
        "fp8",
    ),
    "kv_cache_dtype": ("fp8", "fp8_e4m3fn", "fp8_e5m2"),
}
QUANTIZE_NOTE = "Conveyor quantizes at load to int8 or int4 (--quantize int8|int4) from the unquantized checkpoint"
# Environment variables TGI reads that Conveyor reads under another name.
LEGACY_ENVIRONMENT = {"MAX_INPUT_LENGTH": "max_input_tokens"}


class TgiFlagError(SystemExit):
    """A TGI flag or value Conveyor cannot honour: one line naming it."""


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(argv: Sequence[str]) -> dict[str, str | None]:
    """Every --long-flag on the command line, with the value that follows it (or after '=')."""
    found: dict[str, str | None] = {}
    for i, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        found[name] = value if (eq or value is not None) else None
    return found


def _check_value(name: str, value: str | None, where: str) -> None:
    if value is not None and value.lower() in REFUSED_VALUES.get(name, ()):
        raise TgiFlagError(f"conveyor-launcher: {where} {value} is TGI's and not supported here; {QUANTIZE_NOTE}")


def translate(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """TGI's command line and environment as Conveyor's command line, and the environment variables to set.

    Raises TgiFlagError (a SystemExit with one line) for a TGI flag or variable Conveyor has no equivalent of."""
    given = _given(argv)
    out: list[str] = []
    env: dict[str, str] = {}
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        if key in REFUSED:
            raise TgiFlagError(f"conveyor-launcher: TGI's {_option(key)} is not supported here ({REFUSED[key]})")
        if key in given:
            _check_value(key, given[key], _option(key))
        if key in RENAMED:
            out.append(_option(RENAMED[key]) + (f"={value}" if eq else ""))
            continue
        if key in TO_ENVIRONMENT:
            if not eq:
                skip = True
            if given[key] is not None:
                env[TO_ENVIRONMENT[key]] = str(given[key])
            continue
        out.append(token)
    named = {RENAMED.get(k, k) for k in given}
    for key in (*SAME, *RENAMED):
        variable = key.upper()
        target = RENAMED.get(key, key)
        if key in NOT_FROM_ENVIRONMENT or target in named or not environ.get(variable):
            continue
        _check_value(target, environ[variable], variable)
        out += [_option(target), environ[variable]]
        named.add(target)
    for variable, target in LEGACY_ENVIRONMENT.items():
        if environ.get(variable) and target not in named:
            out += [_option(target), environ[variable]]
            named.add(target)
    for key, variable in TO_ENVIRONMENT.items():
        if environ.get(key.upper()) and variable not in environ and variable not in env:
            env[variable] = environ[key.upper()]
    for key, reason in REFUSED.items():
        if key not in NOT_FROM_ENVIRONMENT and environ.get(key.upper()):
            raise TgiFlagError(f"conveyor-launcher: TGI's {key.upper()} is set and not supported here ({reason})")
    return out, env
