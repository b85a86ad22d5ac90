"""The model's own sampling defaults, from its `generation_config.json`, for requests that leave them unset.

Chat models ship the sampling they were tuned for (Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama 3:
temperature 0.6, top_p 0.9), and vLLM and transformers' `generate()` apply it when a request does not say otherwise.
Conveyor follows `generate()`'s reading of the file: the warpers (the `Sampling` fields marked `WARPER`:
temperature, top_k, top_p...) apply only where the file turns sampling on (`do_sample: true`), since `generate()`
decodes greedily otherwise whatever they say; `repetition_penalty` applies either way, as in `generate()`. A request
that sets a field keeps its value, and one that asks for greedy decoding (`do_sample: false`, OpenAI's `temperature:
0`) gets none of the warpers. Values are checked by the same rules as a request's; one the rules refuse is dropped
with a warning at startup rather than failing every request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.router.api.tgi import WARPERS, Sampling

log = logging.getLogger(__name__)

ALWAYS = ("repetition_penalty",)


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # do_sample and the warpers, when the file samples
    always: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, model_dir: str | Path, check: Any) -> GenerationDefaults:
        """From `model_dir`/generation_config.json (none there: no defaults). `check(name, value)` is the
        request validator's check for that parameter; it returns the value to use or raises ValueError."""
        path = Path(model_dir) / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        sampling = {name: config[name] for name in WARPERS if config.get(name) is not None}
        always = {name: config[name] for name in ALWAYS if config.get(name) is not None}
        if config.get("do_sample") is not True:
            sampling = {}
        else:
            sampling["do_sample"] = True
        return cls(_checked(sampling, check), _checked(always, check))

    def apply(self, sampling: Sampling) -> Sampling:
        """The request's sampling with the defaults it left unset filled in."""
        given = sampling.model_fields_set
        greedy = "do_sample" in given and not sampling.do_sample
        defaults = {**self.always, **({} if greedy else self.sampling)}
        unset = {name: value for name, value in defaults.items() if name not in given}
        return sampling.model_copy(update=unset) if unset else sampling

    def to_json(self) -> dict[str, Any]:
        """What `/info` shows as `generation_defaults`."""
        return {**self.sampling, **self.always}


def _checked(values: dict[str, Any], check: Any) -> dict[str, Any]:
    kept = {}
    for name, value in values.items():
        try:
            kept[name] = check(name, value)
        except ValueError as exc:
            log.warning("generation_config.json: %s ignored: %s", name, exc)
    return kept
