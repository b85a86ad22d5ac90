"""The tool-call parsers by name (`--tool-call-parser`, vLLM's names), and the choice of one for the served model:
the flag if given, else the family whose markers its chat template holds (config.json's `model_type` breaking a
tie), else Hermes' format, the one most open templates teach."""

from __future__ import annotations

from conveyor.router.pipeline.tool_parsers.family import ToolFormat
from conveyor.router.pipeline.tool_parsers.hermes import HERMES
from conveyor.router.pipeline.tool_parsers.llama3_json import LLAMA3_JSON
from conveyor.router.pipeline.tool_parsers.mistral import MISTRAL
from conveyor.router.pipeline.tool_parsers.phi4_mini_json import PHI4_MINI_JSON

# Most specific markers first: a template that names two formats gets the first (unless model_type says).
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (MISTRAL, PHI4_MINI_JSON, LLAMA3_JSON, HERMES)}
FALLBACK = HERMES


def choose_tool_format(template: str, model_type: str | None = None, override: str | None = None) -> ToolFormat:
    if override is not None:
        return FORMATS[override]
    taught = [f for f in FORMATS.values() if any(marker in template for marker in f.markers)]
    preferred = [f for f in taught if model_type in f.model_types]
    return (preferred or taught or [FALLBACK])[0]
