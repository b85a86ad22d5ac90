"""LoRA adapters on the shard: requests for several adapters and the base model in one batch, each exactly as
transformers' `generate()` on the base model with that adapter merged; what is refused, and that the engine serves
on after a refusal; loading, unloading and reloading live; the tensor-parallel slicing; and that a step without
adapter tokens runs no LoRA operation at all.

The engine is driven step by step (as tests/unit/test_speculation.py does), requests joining the batch at different
steps, so one forward mixes prompt chunks and decode rows of different adapters.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ALL_PROJECTIONS, greedy_reference, one_torch_thread, save_lora_adapter
from safetensors.torch import load_file, save_file

from conveyor.shard.adapters.adapter_files import AdapterError
from conveyor.shard.adapters.served_adapters import ServedAdapters, column_rows, row_columns
from conveyor.shard.batch.request_state import BadRequest
from conveyor.shard.batch.running_batch import RunningBatch
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights
from conveyor.shard.step.engine import Engine
from conveyor.v1 import shard_pb2 as pb

BLOCKS = 16  # per request: 256 tokens
POOL = 8 * BLOCKS
CPU = torch.device("cpu")
PROMPT, OTHER = "def add(a, b):", "class Queue:\n    def __init__(self):"
NEW_TOKENS = 20
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3 stores q/k/v and gate/up fused


@dataclass(frozen=True)
class Plan:
    """One request of a driven run: it joins the batch before step `join`."""

    id: int
    join: int
    prompt: str
    adapter: str = ""
    max_new_tokens: int = NEW_TOKENS


_MERGED: dict[tuple[Path, str, int], list[int]] = {}


def merged_reference(model_dir: Path, adapter: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate()` on the base model with the adapter merged into its weights (PEFT's own
    merge): the oracle for an adapter's requests."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = (adapter, prompt, max_new_tokens)
    if key not in _MERGED:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
        ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
        with torch.inference_mode(), one_torch_thread():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        _MERGED[key] = out[0, ids.shape[1] :].tolist()
    return list(_MERGED[key])


def reference(model_dir: Path, adapters: dict[str, Path], plan: Plan) -> list[int]:
    if not plan.adapter:
        return greedy_reference(model_dir, plan.prompt, plan.max_new_tokens)
    return merged_reference(model_dir, adapters[plan.adapter], plan.prompt, plan.max_new_tokens)


def _request(engine: Engine, plan: Plan) -> pb.Request:
    return pb.Request(
        id=plan.id,
        input_ids=engine.tokenizer(plan.prompt).input_ids,
        parameters=pb.SamplingParameters(),
        stopping_parameters=pb.StoppingParameters(max_new_tokens=plan.max_new_tokens, ignore_eos_token=True),
        blocks=range(plan.id * BLOCKS, (plan.id + 1) * BLOCKS),
        adapter=plan.adapter,
    )


def generate(engine: Engine, plans: list[Plan], speculate: int = 0) -> dict[int, list[int]]:
    """Runs the plans to the end, each request joining at its step (with prompt-lookup drafts if `speculate`);
    returns each request's tokens."""
    tokens: dict[int, list[int]] = {p.id: [] for p in plans}
    batch: RunningBatch | None = None
    step = 0
    while batch is not None or any(p.join >= step for p in plans):
        joining = [_request(engine, p) for p in plans if p.join == step]
        batches = [] if batch is None else [batch]
        if joining:
            new = pb.Batch(id=100 + step, requests=joining, size=len(joining))
            batches.append(RunningBatch.from_pb(new, engine.states(new)))
        if batches:
            generations, batch, _ = engine.step(RunningBatch.concatenate(batches))
            for g in generations:
                tokens[g.request_id].extend(g.tokens.ids)
            done = {g.request_id for g in generations if g.HasField("finished")}
            live = [r.id for r in batch.requests if r.id not in done] if batch is not None else []
            batch = batch.filter(live) if live else None
            if batch is not None and speculate:
                batch.update([_speculate(engine, r, speculate) for r in batch.decoding])
        step += 1
    return tokens


def _speculate(engine: Engine, state, speculate: int) -> pb.RequestUpdate:
    """As the router grows a drafting row: blocks for its next token and its drafts, from its own range."""
    needed = -(-(state.num_computed_tokens + 1 + speculate) // engine.block_size)
    start = state.id * BLOCKS + len(state.block_table)
    return pb.RequestUpdate(
        request_id=state.id, speculate=speculate, new_blocks=range(start, state.id * BLOCKS + needed)
    )


@pytest.fixture(scope="module")
def engine(tiny_model: Path, lora_adapters: dict[str, Path]) -> Engine:
    """The tiny model with both test adapters loaded at start; room for one more (--max-loras 3)."""
    adapters = [(name, str(path)) for name, path in lora_adapters.items()]
    engine = Engine(tiny_model, "float32", CPU, ProcessGroup(0, 1), adapters=adapters, max_loras=3)
    engine.cache = engine.allocate(POOL)
    return engine


MIXED = [
    Plan(0, 0, PROMPT),
    Plan(1, 0, PROMPT, "qv"),
    Plan(2, 2, PROMPT, "all"),
    Plan(3, 3, OTHER, "qv", 12),
    Plan(4, 5, OTHER),
    Plan(5, 5, OTHER, "all", 15),
]


def test_base_and_adapter_requests_in_one_batch_each_give_their_merged_models_tokens(
    engine: Engine, tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    tokens = generate(engine, MIXED)
    for plan in MIXED:
        assert tokens[plan.id] == reference(tiny_model, lora_adapters, plan), plan
    for name in lora_adapters:  # each adapter really changes the output
        assert merged_reference(tiny_model, lora_adapters[name], PROMPT, NEW_TOKENS) != tokens[0], name


def test_prompt_lookup_drafts_are_verified_through_the_adapter(
    engine: Engine, tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    repeating = "one two three four. one two three four. one two three four. one two"
    plans = [Plan(0, 0, repeating, "all", 30), Plan(1, 0, repeating, "", 30), Plan(2, 1, repeating, "qv", 30)]
    tokens = generate(engine, plans, speculate=4)
    for plan in plans:
        assert tokens[plan.id] == reference(tiny_model, lora_adapters, plan), plan


def test_a_draft_models_proposals_are_verified_through_the_adapter(
    tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    """The draft model (here the target's own checkpoint again) has no adapter: it proposes the base model's
    tokens, and the target's forward, adapter included, keeps only its own."""
    from conveyor.shard.step.loading import Draft

    adapters = [(name, str(path)) for name, path in lora_adapters.items()]
    engine = Engine(tiny_model, "float32", CPU, ProcessGroup(0, 1), draft=Draft("self"), adapters=adapters)
    engine.cache = engine.allocate(3 * BLOCKS)
    engine.drafter.allocate(3 * BLOCKS)
    plans = [Plan(0, 0, PROMPT, "qv", 30), Plan(1, 0, PROMPT, "", 30), Plan(2, 2, OTHER, "all", 30)]
    tokens = generate(engine, plans, speculate=4)
    for plan in plans:
        assert tokens[plan.id] == reference(tiny_model, lora_adapters, plan), plan


def test_info_lists_the_adapters_on_this_rank(engine: Engine) -> None:
    info = engine.info()
    assert info.max_loras == 3
    assert [(a.name, a.rank) for a in info.adapters] == [("qv", 8), ("all", 16)]
    assert all(a.weight_bytes > 0 for a in info.adapters)
    # float32, per layer: q/v of 8 columns each (A 64 wide; B 64 + 32 + 32 out) ...
    assert info.adapters[0].weight_bytes == 2 * 2 * 8 * (64 + 128) * 4


def test_a_step_without_adapter_tokens_runs_no_lora_operation(engine: Engine) -> None:
    before = engine.adapters.step.ops
    generate(engine, [Plan(0, 0, PROMPT, "", 3), Plan(1, 1, OTHER, "", 3)])
    assert engine.adapters.step.ops == before
    generate(engine, [Plan(0, 0, PROMPT, "qv", 1)])
    layers = engine.config.num_hidden_layers
    assert engine.adapters.step.ops == before + layers  # one forward, through the q/k/v layers alone ("qv"'s kind)


def test_only_layers_an_adapter_targets_carry_a_site_and_none_without_adapters(
    tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    from transformers import AutoConfig

    from conveyor.shard.models import model_for

    group = ProcessGroup(0, 1)
    model = model_for(AutoConfig.from_pretrained(tiny_model), Weights(tiny_model, group, torch.float32, CPU))
    loras = ServedAdapters(model, group, torch.float32, CPU, 2, [str(tiny_model)])

    def carrying() -> set[str]:
        return {site.kind for site in loras.sites if site.linear.lora is not None}

    assert carrying() == set()
    loras.load("qv", "qv", lora_adapters["qv"])
    assert carrying() == {"qkv"}
    loras.load("all", "all", lora_adapters["all"])
    assert carrying() == {"qkv", "o", "gate_up", "down"}
    loras.unload("all")
    loras.unload("qv")
    assert carrying() == set()


def test_a_request_naming_an_unknown_adapter_is_refused(engine: Engine) -> None:
    request = _request(engine, Plan(0, 0, PROMPT, "nope"))
    with pytest.raises(BadRequest, match="adapter 'nope' is not loaded"):
        engine.states(pb.Batch(requests=[request]))


def test_load_use_unload_and_reload_live(engine: Engine, tiny_model: Path, lora_adapters: dict[str, Path]) -> None:
    source = str(lora_adapters["qv"])
    described = engine.load_adapter("again", source)
    assert (described.name, described.source, described.rank) == ("again", source, 8)
    plan = Plan(0, 0, OTHER, "again", 12)
    expected = merged_reference(tiny_model, lora_adapters["qv"], OTHER, 12)
    assert generate(engine, [plan])[0] == expected
    engine.unload_adapter("again")
    assert [a.name for a in engine.info().adapters] == ["qv", "all"]
    with pytest.raises(BadRequest, match="not loaded"):
        engine.states(pb.Batch(requests=[_request(engine, plan)]))
    engine.load_adapter("again", source)
    assert generate(engine, [plan, Plan(1, 0, OTHER, "all", 12)])[0] == expected
    engine.unload_adapter("again")


def test_unloading_an_adapter_a_cached_batch_uses_is_refused(engine: Engine, lora_adapters: dict[str, Path]) -> None:
    engine.load_adapter("held", str(lora_adapters["all"]))
    request = _request(engine, Plan(0, 0, PROMPT, "held", 4))
    batch = RunningBatch.from_pb(
        pb.Batch(id=1, requests=[request], size=1), engine.states(pb.Batch(requests=[request]))
    )
    _, batch, _ = engine.step(batch)
    with pytest.raises(AdapterError, match="still used"):
        engine.unload_adapter("held")
    del batch
    engine.unload_adapter("held")
    with pytest.raises(AdapterError, match="'held' is not loaded"):
        engine.unload_adapter("held")


def test_more_adapters_than_max_loras_are_refused(engine: Engine, lora_adapters: dict[str, Path]) -> None:
    engine.load_adapter("third", str(lora_adapters["qv"]))
    with pytest.raises(AdapterError, match="3 adapters are loaded.*--max-loras"):
        engine.load_adapter("fourth", str(lora_adapters["qv"]))
    engine.unload_adapter("third")


def test_loading_a_name_again_answers_the_one_loaded_unless_the_source_differs(
    engine: Engine, lora_adapters: dict[str, Path]
) -> None:
    assert engine.load_adapter("qv", str(lora_adapters["qv"])).rank == 8
    with pytest.raises(AdapterError, match="'qv' is already loaded from"):
        engine.load_adapter("qv", str(lora_adapters["all"]))


# --- the RPCs -------------------------------------------------------------------------------------------------


class Aborted(Exception):
    """What a real context's abort raises, with the status and the message."""


class Context:
    """The two things the shard's RPC wrapper asks of a gRPC context."""

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code, details: str) -> None:
        raise Aborted(code, details)


async def test_the_rpcs_load_and_unload_and_refuse_with_invalid_argument(
    engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import grpc

    from conveyor import hub
    from conveyor.shard.service.grpc_service import ShardService
    from conveyor.shard.service.torch_thread import TorchThread

    def unreachable(repo_id: str, *args, **kwargs) -> Path:
        raise hub.HubError(f"{repo_id}: the Hub cannot be reached")

    monkeypatch.setattr(hub, "download", unreachable)
    service = ShardService(engine, [], TorchThread())
    load = pb.LoadAdapterRequest(name="live", source=str(lora_adapters["qv"]))
    assert (await service.LoadAdapter(load, Context())).adapter.rank == 8
    assert "live" in [a.name for a in (await service.Info(pb.InfoRequest(), Context())).adapters]
    await service.UnloadAdapter(pb.UnloadAdapterRequest(name="live"), Context())
    refused = {
        "no adapter_config.json": pb.LoadAdapterRequest(name="x", source=str(tmp_path)),
        "the Hub cannot be reached": pb.LoadAdapterRequest(name="x", source="org/adapter"),  # a SystemExit, caught
        "adapter name 'a b'": pb.LoadAdapterRequest(name="a b", source=str(lora_adapters["qv"])),
        "'live' is not loaded": pb.UnloadAdapterRequest(name="live"),
    }
    for message, request in refused.items():
        call = service.UnloadAdapter if isinstance(request, pb.UnloadAdapterRequest) else service.LoadAdapter
        with pytest.raises(Aborted) as raised:
            await call(request, Context())
        assert raised.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert message in raised.value.args[1]
    service.torch_thread.shutdown()


# --- refusals -----------------------------------------------------------------------------------------------


def _copy(adapter: Path, to: Path, config: dict | None = None, rename: tuple[str, str] | None = None) -> Path:
    """A copy of an adapter with its config fields changed and its tensor names rewritten."""
    shutil.copytree(adapter, to)
    if config is not None:
        path = to / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if rename is not None:
        tensors = load_file(to / "adapter_model.safetensors")
        save_file({k.replace(*rename): v for k, v in tensors.items()}, to / "adapter_model.safetensors")
    return to


REFUSED_CONFIGS = {
    "dora": ({"use_dora": True}, "uses DoRA"),
    "bias": ({"bias": "all"}, "trains biases"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    "embedding": ({"target_modules": ["q_proj", "embed_tokens"]}, "targets embed_tokens"),
    "another base": ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}, "trained on 'meta-llama/Llama-3.2-1B'"),
    "not lora": ({"peft_type": "IA3"}, "is a IA3 adapter"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
def test_a_config_conveyor_does_not_serve_is_refused(
    engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path, case: str
) -> None:
    change, message = REFUSED_CONFIGS[case]
    bad = _copy(lora_adapters["qv"], tmp_path / "bad", config=change)
    _refused(engine, bad, f"adapter 'bad'.*{message}")


def test_a_target_module_the_model_lacks_is_refused(
    engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    bad = _copy(lora_adapters["qv"], tmp_path / "bad", {"target_modules": ["qkv_proj"]}, (".q_proj.", ".qkv_proj."))
    _refused(engine, bad, "targets self_attn.qkv_proj, which this model does not have .it has q_proj, k_proj")


def test_an_lm_head_tensor_is_refused(engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(lora_adapters["qv"], tmp_path / "bad", rename=("model.layers.1.self_attn.v_proj", "lm_head"))
    _refused(engine, bad, "targets lm_head")


def test_an_adapter_of_another_model_size_is_refused(engine: Engine, tiny_model: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "tiny"  # the same name: only the shapes differ
    config = json.loads((tiny_model / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(**{**config, "hidden_size": 32, "intermediate_size": 64})).save_pretrained(other)
    bad = save_lora_adapter(other, tmp_path / "bad", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    _refused(engine, bad, r"lora_A of layers.0.self_attn.q_proj is \[8, 32\], the base model's q_proj has 64 input")


def test_a_wrong_rank_is_refused(engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(lora_adapters["qv"], tmp_path / "bad", config={"r": 4})
    _refused(engine, bad, r"lora_A is \[8, 64\] and lora_B \[64, 8\], not rank 4")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_an_unreadable_weights_file_is_refused(
    engine: Engine, lora_adapters: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    bad = _copy(lora_adapters["qv"], tmp_path / "bad")
    weights = bad / "adapter_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x07" * 4096)
    else:
        weights.unlink()
    _refused(engine, bad, "cannot be read" if damage != "missing" else "no adapter_model.safetensors")


def test_a_source_that_is_no_adapter_is_refused(engine: Engine, tmp_path: Path) -> None:
    _refused(engine, tmp_path, "no adapter_config.json there")


def _refused(engine: Engine, source: Path, message: str) -> None:
    """The load raises AdapterError matching `message`, and the engine serves on, its adapters as they were."""
    before = list(engine.info().adapters)
    with pytest.raises(AdapterError, match=message) as raised:
        engine.load_adapter("bad", str(source))
    assert "\n" not in str(raised.value)
    assert list(engine.info().adapters) == before
    assert generate(engine, [Plan(0, 0, OTHER, "qv", 2)])[0]


# --- other architectures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("model_fixture", "targets"), [("phi3_model", PHI3_TARGETS), ("gemma3_model", None)])
def test_phi3_and_gemma3_serve_adapters_exactly(
    request: pytest.FixtureRequest, tmp_path: Path, model_fixture: str, targets: list[str] | None
) -> None:
    """Phi-3's fused q/k/v and gate/up (a `qkv_proj` adapter fills every part) and Gemma 3's layers of another
    head size, each beside its base model in one batch."""
    model_dir = request.getfixturevalue(model_fixture)
    adapter = save_lora_adapter(
        model_dir, tmp_path / "a", r=8, lora_alpha=16, target_modules=targets or ALL_PROJECTIONS
    )
    engine = Engine(model_dir, "float32", CPU, ProcessGroup(0, 1), adapters=[("a", str(adapter))])
    engine.cache = engine.allocate(2 * BLOCKS)
    tokens = generate(engine, [Plan(0, 0, PROMPT, "a"), Plan(1, 1, PROMPT)])
    assert tokens[0] == merged_reference(model_dir, adapter, PROMPT, NEW_TOKENS)
    assert tokens[1] == greedy_reference(model_dir, PROMPT, NEW_TOKENS) != tokens[0]


def test_a_multimodal_wrappers_text_layers_are_read_and_its_vision_tower_left_out(tmp_path: Path) -> None:
    from conveyor.shard.adapters.adapter_files import read

    names = [
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_{}.weight",
        "base_model.model.language_model.model.layers.1.mlp.down_proj.lora_{}",  # old names: no `.weight`
        "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_{}.weight",
    ]
    tensors = {name.format(m): torch.ones(*shape) for name in names for m, shape in (("A", (4, 8)), ("B", (16, 4)))}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_rslora": True}))
    files = read("mm", tmp_path, ["gemma-3-4b-it"])
    assert sorted(str(t) for t in files.matrices) == ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"]
    assert files.rank == 4 and files.scale == 4.0


def test_smolvlms_text_layers_are_read_and_its_connector_left_out(tmp_path: Path) -> None:
    from conveyor.shard.adapters.adapter_files import read

    names = [
        "base_model.model.model.text_model.layers.0.self_attn.v_proj.lora_{}.weight",
        "base_model.model.model.connector.modality_projection.proj.lora_{}.weight",
        "base_model.model.model.vision_model.encoder.layers.0.mlp.fc1.lora_{}.weight",
    ]
    tensors = {name.format(m): torch.ones(*shape) for name in names for m, shape in (("A", (4, 8)), ("B", (16, 4)))}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    files = read("smol", tmp_path, ["SmolVLM-256M-Instruct"])
    assert sorted(str(t) for t in files.matrices) == ["layers.0.self_attn.v_proj"]


# --- a quantized base ---------------------------------------------------------------------------------------


def test_a_quantized_base_serves_adapters(tiny_model: Path, lora_adapters: dict[str, Path]) -> None:
    from conveyor.shard.layers.quantize import QuantizationUnavailable

    adapters = [(name, str(path)) for name, path in lora_adapters.items()]
    try:
        engine = Engine(tiny_model, "float32", CPU, ProcessGroup(0, 1), "int8", adapters=adapters)
    except QuantizationUnavailable as exc:
        pytest.skip(str(exc))
    engine.cache = engine.allocate(3 * BLOCKS)
    tokens = generate(engine, [Plan(0, 0, PROMPT), Plan(1, 0, PROMPT, "qv"), Plan(2, 1, PROMPT, "all")])
    assert tokens[1] != tokens[0] and tokens[2] != tokens[0]
    assert all(len(t) == NEW_TOKENS for t in tokens.values())


# --- tensor parallelism -------------------------------------------------------------------------------------


def test_column_rows_slice_b_as_the_weights_are_sliced(tmp_path: Path) -> None:
    b = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    save_file({"w.weight": b}, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        weights = Weights(tmp_path, ProcessGroup(rank, 2), torch.float32, CPU)
        assert torch.equal(column_rows(b, [8, 2, 2], rank, 2), weights.get_sharded_parts("w.weight", [8, 2, 2]))
    a = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8)
    assert torch.equal(torch.cat([row_columns(a, r, 2) for r in range(2)], dim=1), a)


@pytest.mark.parametrize("model_fixture", ["tiny_model", "phi3_model"])
def test_two_ranks_updates_add_up_to_the_merged_adapters(
    request: pytest.FixtureRequest, lora_adapters: dict[str, Path], tmp_path: Path, model_fixture: str
) -> None:
    """Each rank's slices of an adapter on every projection, on its own slice of the model: the column-parallel
    layers' outputs joined part by part, and the row-parallel layers' partial outputs summed, are the change PEFT's
    merge makes (Phi-3: its fused q/k/v and gate/up split per part, as the weights are)."""
    from transformers import AutoConfig

    model_dir = request.getfixturevalue(model_fixture)
    adapter = lora_adapters["all"]
    if model_fixture == "phi3_model":
        adapter = save_lora_adapter(model_dir, tmp_path / "phi3", r=16, lora_alpha=8, target_modules=PHI3_TARGETS)
    config = AutoConfig.from_pretrained(model_dir)
    delta = _merged_delta(model_dir, adapter, layer=1)
    gen = torch.Generator().manual_seed(1)
    inputs = {kind: torch.randn(5, d.shape[1], generator=gen) for kind, d in delta.items()}
    outputs = [_rank_updates(model_dir, config, adapter, inputs, rank) for rank in range(2)]
    for kind, full in delta.items():
        expected = inputs[kind] @ full.T
        if kind in ("o", "down"):
            torch.testing.assert_close(outputs[0][kind][0] + outputs[1][kind][0], expected, rtol=1e-4, atol=1e-5)
            continue
        parts = outputs[0][kind][1]
        for i, want in enumerate(expected.split([2 * p for p in parts], dim=1)):
            got = torch.cat([out[kind][0].split(parts, dim=1)[i] for out in outputs], dim=1)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _rank_updates(model_dir: Path, config, adapter: Path, inputs: dict, rank: int) -> dict:
    """Per kind of layer 1, what rank `rank` of 2 adds to its output (its input slice for a row-parallel layer),
    with the layer's parts here."""
    from conveyor.shard.models import model_for

    group = ProcessGroup(rank, 2)
    model = model_for(config, Weights(model_dir, group, torch.float32, CPU))
    loras = ServedAdapters(model, group, torch.float32, CPU, 1, [str(model_dir)])
    loras.load("a", "a", adapter)
    loras.begin(["a"], [5])
    layer = model.layers[1]
    linears = {"qkv": layer.attention.qkv, "o": layer.attention.o_proj, "gate_up": layer.mlp.gate_up}
    linears["down"] = layer.mlp.down
    updates = {}
    for kind, linear in linears.items():
        x = inputs[kind]
        if kind in ("o", "down"):
            share = x.shape[1] // 2
            x = x[:, rank * share : (rank + 1) * share]
        out = torch.zeros(x.shape[0], linear.gemm.out_features)
        linear.lora(x, out)
        updates[kind] = (out, list(getattr(linear, "parts", [])))
    return updates


def _merged_delta(model_dir: Path, adapter: Path, layer: int) -> dict[str, torch.Tensor]:
    """PEFT's merged weight minus the base weight, per kind of our layers (q/k/v and gate/up stacked as ours fuse
    them), for one decoder layer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = _by_kind(base.model.layers[layer])
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().model.layers[layer]
    return {kind: weight - before[kind] for kind, weight in _by_kind(merged).items()}


def _by_kind(layer) -> dict[str, torch.Tensor]:
    attention, mlp = layer.self_attn, layer.mlp

    def stacked(owner, fused: str, names: list[str]) -> torch.Tensor:
        if hasattr(owner, fused):
            return getattr(owner, fused).weight.detach().clone()
        return torch.cat([getattr(owner, n).weight.detach() for n in names])

    return {
        "qkv": stacked(attention, "qkv_proj", ["q_proj", "k_proj", "v_proj"]),
        "o": attention.o_proj.weight.detach().clone(),
        "gate_up": stacked(mlp, "gate_up_proj", ["gate_proj", "up_proj"]),
        "down": mlp.down_proj.weight.detach().clone(),
    }
