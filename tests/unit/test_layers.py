"""Tensor-parallel layers, checkpoint slicing and tied embeddings.

The parallel layers run for real on 2 gloo ranks on CPU: one spawn (module-scoped fixture) builds every layer
from one safetensors checkpoint on both ranks, runs each on a fixed input, and saves what it got per rank; the
tests then compare those results with the unsharded computation done here on the full tensors.

Tensors fed to the layers whose output must match bit for bit are random multiples of 1/8 in [-1, 1): every
product and partial sum of a few of them is exactly representable in float32, so a sharded matmul equals the
full one exactly whatever order the BLAS kernel adds in, and `torch.equal` is a fair requirement on any machine.
Ordinary random floats are checked as well, with tolerances where the order of additions legitimately changes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import WeightError, Weights

WORLD = 2
HIDDEN = 6  # input features of the column-parallel layers and the LM head
ROW_IN = 8  # input features of the row-parallel layer, split 4 + 4
VOCAB = 10  # rank 0 holds ids 0-4, rank 1 ids 5-9
TOKENS = 3
Q_ROWS, KV_ROWS = 8, 4
EMBED_IDS = [0, 4, 5, 9, 3, 7, 0, 6]  # both halves of the vocabulary, both edges of each, repeats

CPU = torch.device("cpu")


def _dyadic(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random multiples of 1/8 in [-1, 1): exact arithmetic for the small sums these layers do."""
    return torch.randint(-8, 8, shape, generator=gen).float() / 8


def _checkpoint() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint's tensors and the layers' inputs, the same on every call."""
    gen = torch.Generator().manual_seed(20240611)
    tensors = {
        "grid.weight": torch.randn(4, 6, generator=gen),
        # A fused q/k/v with different row counts, exact values...
        "q.weight": _dyadic(gen, Q_ROWS, HIDDEN),
        "q.bias": _dyadic(gen, Q_ROWS),
        "k.weight": _dyadic(gen, KV_ROWS, HIDDEN),
        "k.bias": _dyadic(gen, KV_ROWS),
        "v.weight": _dyadic(gen, KV_ROWS, HIDDEN),
        "v.bias": _dyadic(gen, KV_ROWS),
        # ...and the same with ordinary floats.
        "fq.weight": torch.randn(Q_ROWS, HIDDEN, generator=gen),
        "fq.bias": torch.randn(Q_ROWS, generator=gen),
        "fk.weight": torch.randn(KV_ROWS, HIDDEN, generator=gen),
        "fk.bias": torch.randn(KV_ROWS, generator=gen),
        "fv.weight": torch.randn(KV_ROWS, HIDDEN, generator=gen),
        "fv.bias": torch.randn(KV_ROWS, generator=gen),
        "o.weight": torch.randn(HIDDEN, ROW_IN, generator=gen),
        "o.bias": torch.randn(HIDDEN, generator=gen),
        "embed.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "head.weight": _dyadic(gen, VOCAB, HIDDEN),
        "fhead.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
    }
    inputs = {
        "x": _dyadic(gen, TOKENS, HIDDEN),
        "x_float": torch.randn(TOKENS, HIDDEN, generator=gen),
        "x_row": torch.randn(TOKENS, ROW_IN, generator=gen),
        "ids": torch.tensor(EMBED_IDS),
        "hidden": _dyadic(gen, TOKENS, HIDDEN),
        "hidden_float": torch.randn(TOKENS, HIDDEN, generator=gen),
    }
    return tensors, inputs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, model_dir: str, inputs_path: str, out_dir: str) -> None:
    """One rank: joins the group as the launcher would have it, builds every layer, saves its outputs."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    from conveyor.shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
    from conveyor.shard.runtime.process_group import initialize

    group = initialize(CPU, timeout=60)
    try:
        inputs = torch.load(inputs_path)
        weights = Weights(model_dir, group, torch.float32, CPU)
        part = ROW_IN // group.world_size
        my_x_row = inputs["x_row"][:, group.rank * part : (group.rank + 1) * part].contiguous()
        with torch.no_grad():
            results = {
                "group": torch.tensor([group.rank, group.world_size]),
                "grid_dim0": weights.get_sharded("grid.weight", dim=0),
                "grid_dim1": weights.get_sharded("grid.weight", dim=1),
                "qkv": ColumnParallelLinear.load(weights, ["q", "k", "v"], bias=True)(inputs["x"]),
                "qkv_float": ColumnParallelLinear.load(weights, ["fq", "fk", "fv"], bias=True)(inputs["x_float"]),
                "row": RowParallelLinear.load(weights, "o", bias=True)(my_x_row),
                "embed": VocabParallelEmbedding.load(weights, "embed.weight")(inputs["ids"]),
                "logits": ParallelLMHead.load(weights, "head.weight")(inputs["hidden"]),
                "logits_float": ParallelLMHead.load(weights, "fhead.weight")(inputs["hidden_float"]),
                # rank 0 offers 15, rank 1 offers 10: both must agree on 10.
                "min": torch.tensor(group.min(10 + 5 * (group.world_size - 1 - group.rank))),
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory):
    """(full tensors, inputs, [rank 0's results, rank 1's results]) from one 2-rank run."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("tensor_parallel")
    tensors, inputs = _checkpoint()
    model_dir = root / "model"
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    torch.save(inputs, root / "inputs.pt")
    out = root / "out"
    out.mkdir()
    for attempt in range(2):  # a second try only if another process took the free port in between
        try:
            args = (WORLD, _free_port(), str(model_dir), str(root / "inputs.pt"), str(out))
            mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
            break
        except mp.ProcessRaisedException as exc:
            if attempt or "address already in use" not in str(exc).lower():
                raise
    results = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return tensors, inputs, results


def test_each_rank_joined_the_group_with_its_rank(parallel):
    _, _, results = parallel
    assert [r["group"].tolist() for r in results] == [[0, 2], [1, 2]]


def test_get_sharded_reads_this_ranks_half(parallel):
    tensors, _, results = parallel
    full = tensors["grid.weight"]
    for rank, result in enumerate(results):
        assert torch.equal(result["grid_dim0"], full[rank * 2 : (rank + 1) * 2])
        assert torch.equal(result["grid_dim1"], full[:, rank * 3 : (rank + 1) * 3])
    assert not torch.equal(results[0]["grid_dim0"], results[1]["grid_dim0"])
    assert not torch.equal(results[0]["grid_dim1"], results[1]["grid_dim1"])


def _fused_halves(tensors: dict, prefixes: list[str], x: torch.Tensor, rank: int) -> torch.Tensor:
    parts = []
    for p in prefixes:
        full = F.linear(x, tensors[f"{p}.weight"], tensors[f"{p}.bias"])
        half = full.shape[-1] // WORLD
        parts.append(full[:, rank * half : (rank + 1) * half])
    return torch.cat(parts, dim=-1)


def test_column_parallel_fuses_each_ranks_q_k_v_halves(parallel):
    tensors, inputs, results = parallel
    for rank, result in enumerate(results):
        expected = _fused_halves(tensors, ["q", "k", "v"], inputs["x"], rank)
        assert result["qkv"].shape == (TOKENS, (Q_ROWS + 2 * KV_ROWS) // WORLD)
        assert torch.equal(result["qkv"], expected)  # exact: dyadic values, see the module docstring
    assert not torch.equal(results[0]["qkv"], results[1]["qkv"])


def test_column_parallel_with_ordinary_floats(parallel):
    tensors, inputs, results = parallel
    for rank, result in enumerate(results):
        expected = _fused_halves(tensors, ["fq", "fk", "fv"], inputs["x_float"], rank)
        # Not torch.equal: BLAS may block a [3, 8] and a [3, 16] product differently (FMA or not, order of
        # adds), which moves the last bit; any slicing mistake is off by far more than 1e-6.
        torch.testing.assert_close(result["qkv_float"], expected, rtol=0, atol=1e-6)


def test_row_parallel_sums_partial_products_and_adds_the_bias_once(parallel):
    tensors, inputs, results = parallel
    expected = F.linear(inputs["x_row"], tensors["o.weight"], tensors["o.bias"])
    for result in results:
        torch.testing.assert_close(result["row"], expected, rtol=0, atol=1e-5)
    # The bias is large enough that adding it on each rank (twice in all) could not pass the check above.
    assert tensors["o.bias"].abs().max() > 1e-3
    assert torch.equal(results[0]["row"], results[1]["row"])


def test_vocab_parallel_embedding_matches_the_full_lookup(parallel):
    tensors, inputs, results = parallel
    expected = F.embedding(inputs["ids"], tensors["embed.weight"])
    for result in results:
        assert result["embed"].shape == (len(EMBED_IDS), HIDDEN)
        assert torch.equal(result["embed"], expected)


def test_parallel_lm_head_gathers_the_full_logits(parallel):
    tensors, inputs, results = parallel
    expected = F.linear(inputs["hidden"], tensors["head.weight"])
    expected_float = F.linear(inputs["hidden_float"], tensors["fhead.weight"])
    for result in results:
        assert result["logits"].shape == (TOKENS, VOCAB)
        assert torch.equal(result["logits"], expected)  # exact: dyadic values
        torch.testing.assert_close(result["logits_float"], expected_float, rtol=0, atol=1e-6)


def test_min_agrees_across_ranks(parallel):
    _, _, results = parallel
    assert [int(r["min"]) for r in results] == [10, 10]


# --- Weights, in one process -------------------------------------------------------------------------------


def _save(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name))


def test_weights_get_contains_and_missing_tensor(tmp_path: Path):
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    _save(tmp_path, {"layer.weight": full})
    weights = Weights(tmp_path, ProcessGroup(0, 1), torch.float64, CPU)
    assert "layer.weight" in weights
    assert "layer.bias" not in weights
    got = weights.get("layer.weight")
    assert got.dtype == torch.float64 and torch.equal(got, full.double())
    assert torch.equal(weights.get_sharded("layer.weight", dim=0), full.double())  # one rank: all of it
    with pytest.raises(WeightError, match="layer.bias"):
        weights.get("layer.bias")
    with pytest.raises(WeightError, match="layer.bias"):
        weights.get_sharded("layer.bias", dim=0)


def test_weights_reject_a_dimension_that_does_not_split(tmp_path: Path):
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    _save(tmp_path, {"layer.weight": full})
    with pytest.raises(WeightError, match=r"layer\.weight.*does not split into 3"):
        Weights(tmp_path, ProcessGroup(rank=0, world_size=3), torch.float32, CPU).get_sharded("layer.weight", dim=0)
    # The other dimension (6) does split into 3: each rank gets its own third.
    for rank in range(3):
        weights = Weights(tmp_path, ProcessGroup(rank=rank, world_size=3), torch.float32, CPU)
        assert torch.equal(weights.get_sharded("layer.weight", dim=1), full[:, 2 * rank : 2 * rank + 2])


def test_weights_follow_the_index_of_a_split_checkpoint(tmp_path: Path):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 3, generator=gen), torch.randn(5, generator=gen)
    _save(tmp_path, {"a": a}, "model-00001-of-00002.safetensors")
    _save(tmp_path, {"b": b}, "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU)
    assert torch.equal(weights.get("a"), a)
    assert torch.equal(weights.get("b"), b)


def test_weights_need_safetensors_files(tmp_path: Path):
    with pytest.raises(WeightError, match="safetensors"):
        Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU)


# --- the Llama model: head counts and tied embeddings ----------------------------------------------------------


def _llama_config(**overrides):
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=128,
    )
    return LlamaConfig(**{**settings, **overrides})


def test_shape_rejects_heads_that_do_not_divide():
    from conveyor.shard.models.llama import Shape

    with pytest.raises(WeightError, match="heads"):
        Shape(_llama_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2), 4)
    with pytest.raises(WeightError, match="key-value heads"):
        Shape(_llama_config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2), 4)
    shape = Shape(_llama_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2), 2)
    assert (shape.heads_per_rank, shape.kv_heads_per_rank, shape.head_dim) == (3, 1, 8)


def _saved_llama(directory: Path, tied: bool):
    from transformers import LlamaForCausalLM as HFLlama

    config = _llama_config(tie_word_embeddings=tied)
    torch.manual_seed(7)
    model = HFLlama(config)
    model.save_pretrained(directory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    return config, model, names


def test_tied_embeddings_use_the_embedding_as_lm_head(tmp_path: Path):
    from conveyor.shard.models.llama import LlamaForCausalLM

    config, reference, names = _saved_llama(tmp_path, tied=True)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = LlamaForCausalLM(config, Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU))
    embedding = reference.model.embed_tokens.weight.detach()
    assert torch.equal(model.lm_head.gemm.dense(), embedding)
    assert torch.equal(model.embed.weight, embedding)


def test_untied_lm_head_is_read_from_the_checkpoint(tmp_path: Path):
    from conveyor.shard.models.llama import LlamaForCausalLM

    config, reference, names = _saved_llama(tmp_path, tied=False)
    assert "lm_head.weight" in names
    model = LlamaForCausalLM(config, Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU))
    assert torch.equal(model.lm_head.gemm.dense(), reference.lm_head.weight.detach())
    assert not torch.equal(model.lm_head.gemm.dense(), model.embed.weight)


def test_a_fused_tensor_splits_part_by_part(tmp_path: Path):
    """Phi-3's qkv_proj stacks q, k and v rows: each rank takes its share of each part, not a contiguous block."""
    full = torch.arange(20 * 2, dtype=torch.float32).view(20, 2)
    _save(tmp_path, {"qkv.weight": full})
    sizes = [8, 6, 6]
    for rank in range(2):
        got = Weights(tmp_path, ProcessGroup(rank=rank, world_size=2), torch.float32, CPU).get_sharded_parts(
            "qkv.weight", sizes
        )
        rows = [
            *range(4 * rank, 4 * rank + 4),
            *range(8 + 3 * rank, 11 + 3 * rank),
            *range(14 + 3 * rank, 17 + 3 * rank),
        ]
        assert torch.equal(got, full[rows])
    with pytest.raises(WeightError, match="not the 19 its parts add up to"):
        Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU).get_sharded_parts("qkv.weight", [8, 6, 5])
    with pytest.raises(WeightError, match="does not split into 4"):
        Weights(tmp_path, ProcessGroup(0, 4), torch.float32, CPU).get_sharded_parts("qkv.weight", sizes)
