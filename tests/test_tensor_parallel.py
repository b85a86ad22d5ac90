"""Tensor-parallel layers on 2 gloo ranks against the unsharded computation, and weight-loading errors.

One spawn of 2 ranks builds every layer from the same safetensors file and saves what each rank computed; the
tests compare that with plain torch on the whole tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import free_port
from conveyor.shard.distributed import ProcessGroup, initialize
from conveyor.shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.shard.weights import WeightError, Weights

CPU = torch.device("cpu")


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q.weight": rand(8, 6), "q.bias": rand(8), "k.weight": rand(4, 6), "k.bias": rand(4),
        "v.weight": rand(4, 6), "v.bias": rand(4), "o.weight": rand(6, 8), "o.bias": rand(6),
        "embed.weight": rand(10, 6), "head.weight": rand(10, 6), "x": rand(3, 6), "h": rand(3, 8),
    }  # fmt: skip


IDS = torch.tensor([0, 4, 5, 9, 2])  # both halves of the 10-token vocabulary


def _rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = initialize(CPU)
    weights = Weights(folder, group, torch.float32, CPU)
    x, h = weights.get("x"), weights.get("h")
    out = {
        "q_rows": weights.get_sharded("q.weight", dim=0),
        "o_cols": weights.get_sharded("o.weight", dim=1),
        "qkv": ColumnParallelLinear.load(weights, ["q", "k", "v"], bias=True)(x),
        # A row-parallel layer takes this rank's slice of the features (its heads' outputs).
        "o": RowParallelLinear.load(weights, "o", bias=True)(h[:, 4 * rank : 4 * rank + 4]),
        "embed": VocabParallelEmbedding.load(weights, "embed.weight")(IDS),
        "head": ParallelLMHead.load(weights, "head.weight")(x),
        "min": torch.tensor(group.min(10 + rank)),
    }
    torch.save(out, Path(folder) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    folder = tmp_path_factory.mktemp("tp")
    tensors = full_tensors()
    save_file(tensors, folder / "model.safetensors")
    mp.start_processes(_rank, args=(free_port(), str(folder)), nprocs=2, start_method="spawn")
    return tensors, [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def test_each_rank_reads_exactly_its_half(ranks) -> None:
    full, out = ranks
    for r in range(2):
        assert torch.equal(out[r]["q_rows"], full["q.weight"][4 * r : 4 * r + 4])
        assert torch.equal(out[r]["o_cols"], full["o.weight"][:, 4 * r : 4 * r + 4])


def test_fused_column_parallel_gives_each_rank_its_heads(ranks) -> None:
    full, out = ranks
    x = full["x"]
    q, k, v = (F.linear(x, full[f"{p}.weight"], full[f"{p}.bias"]) for p in "qkv")
    for r in range(2):
        expected = torch.cat([q[:, 4 * r : 4 * r + 4], k[:, 2 * r : 2 * r + 2], v[:, 2 * r : 2 * r + 2]], dim=1)
        torch.testing.assert_close(out[r]["qkv"], expected, rtol=0, atol=1e-6)


def test_row_parallel_sums_partials_and_adds_the_bias_once(ranks) -> None:
    full, out = ranks
    expected = F.linear(full["h"], full["o.weight"], full["o.bias"])
    for r in range(2):
        torch.testing.assert_close(out[r]["o"], expected, rtol=0, atol=1e-5)
    assert torch.equal(out[0]["o"], out[1]["o"])


def test_vocab_parallel_embedding_is_exact_on_every_rank(ranks) -> None:
    full, out = ranks
    for r in range(2):
        assert torch.equal(out[r]["embed"], F.embedding(IDS, full["embed.weight"]))


def test_parallel_lm_head_gathers_the_whole_vocabulary(ranks) -> None:
    full, out = ranks
    for r in range(2):
        torch.testing.assert_close(out[r]["head"], F.linear(full["x"], full["head.weight"]), rtol=0, atol=1e-6)


def test_ranks_agree_on_the_smallest_value(ranks) -> None:
    _, out = ranks
    assert [int(o["min"]) for o in out] == [10, 10]


def test_missing_tensors_and_uneven_splits_are_clear_errors(tmp_path: Path) -> None:
    save_file(full_tensors(), tmp_path / "model.safetensors")
    weights = Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU)
    with pytest.raises(WeightError, match="'nope.weight' is missing"):
        weights.get("nope.weight")
    three = Weights(tmp_path, ProcessGroup(0, 3), torch.float32, CPU)
    with pytest.raises(WeightError, match="does not split into 3"):
        three.get_sharded("q.weight", dim=0)


def test_heads_that_do_not_divide_by_the_shards_are_a_clear_error() -> None:
    from transformers import LlamaConfig

    from conveyor.shard.models.llama import Shape

    config = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(WeightError, match="6 attention heads do not divide by 4 shards"):
        Shape(config, 4)
    assert Shape(config, 2).kv_heads_per_rank == 1


def test_tied_embeddings_serve_as_the_lm_head(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as Reference

    from conveyor.shard.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Reference(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = LlamaForCausalLM(config, Weights(tmp_path, ProcessGroup(0, 1), torch.float32, CPU))
    assert torch.equal(model.lm_head.weight, model.embed.weight)
