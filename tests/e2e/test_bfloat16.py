"""bfloat16 on the paged engine, against transformers' own bfloat16 forward.

Token-exactness is not expected in bf16 (two correct implementations round differently, and a near-tie flips),
so the check is on log-probabilities: teacher-forced on the same tokens, every position's log-probabilities of
the reference's top tokens agree within LOGPROB_TOLERANCE nats, a bound above the distance between transformers'
own float32 and bf16 forwards on the tiny model (whose logits are small, so bf16's rounding moves them little);
the test also checks that the weights and KV really are bf16.

The engine's bf16 matmuls run on oneDNN where it has bf16 kernels for the CPU (AVX-512, AMX) and on F.linear
elsewhere (AVX2); the log-probability check runs on both wherever oneDNN has them (CONVEYOR_CPU_BF16=0 takes the
AVX2 path), and on F.linear alone on an AVX2 machine: bf16 is slow there, never wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import free_port, start_server

from conveyor import cpu

LOGPROB_TOLERANCE = 0.03  # nats
PROMPT = "def fibonacci(n):\n    if n < 2:"
TOP = 10


def _reference(model_dir: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _greedy_bf16(model_dir: Path, prompt_ids: list[int], new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0].tolist()


def _ours(model_dir: Path, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Our bf16 log-probabilities at every position: the prompt in one prefill, then one token per decode step."""
    from conveyor.shard.runtime.process_group import ProcessGroup
    from conveyor.shard.step.engine import Engine

    engine = Engine(model_dir, "bfloat16", torch.device("cpu"), ProcessGroup(0, 1))
    blocks = list(range(-(-len(ids) // engine.block_size)))
    engine.cache = engine.allocate(len(blocks))
    assert engine.cache.keys[0].dtype == torch.bfloat16
    assert engine.model.layers[0].mlp.gate_up.gemm.dtype == torch.bfloat16
    assert engine.model.layers[0].mlp.gate_up.gemm.packed == cpu.onednn_bf16()
    with torch.inference_mode():
        rows = [engine.forward([ids[:prompt_len]], [0], [blocks], [prompt_len], [prompt_len])]
        for p in range(prompt_len, len(ids)):
            rows.append(engine.forward([[ids[p]]], [p], [blocks], [p + 1], [1]))
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def _worst_gap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    top = reference.topk(TOP, dim=-1).indices
    return (ours.gather(1, top) - reference.gather(1, top)).abs().max().item()


@pytest.mark.parametrize("bf16_kernels", ["as this run has them", "switched off"])
def test_bf16_log_probabilities_follow_transformers_bf16(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, bf16_kernels: str
):
    if bf16_kernels == "switched off":
        monkeypatch.setenv(cpu.BF16_SWITCH, "0")
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPT).input_ids
    ids = _greedy_bf16(tiny_model, prompt_ids, 24)
    ours = _ours(tiny_model, ids, len(prompt_ids))
    bf16, fp32 = _reference(tiny_model, ids, torch.bfloat16), _reference(tiny_model, ids, torch.float32)
    assert ours.shape == bf16.shape
    gap, fp32_gap = _worst_gap(ours, bf16), _worst_gap(fp32, bf16)
    assert gap <= LOGPROB_TOLERANCE, f"bf16 log-probs {gap:.4f} nats from transformers' bf16 (fp32 is {fp32_gap:.4f})"


def test_bf16_deployment_serves_end_to_end(tiny_model: Path):
    server = start_server(
        tiny_model, "--dtype", "bfloat16", "--max-total-tokens", "256", "--master-port", str(free_port())
    )
    try:
        with server.client() as client:
            assert client.get("/info").json()["model_dtype"] == "bfloat16"
            body = {
                "inputs": PROMPT,
                "parameters": {"max_new_tokens": 12, "details": True, "decoder_input_details": True},
            }
            response = client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        details = response.json()["details"]
    finally:
        assert server.stop() == 0
    prompt_ids = [t["id"] for t in details["prefill"]]
    tokens = details["tokens"]
    assert len(tokens) == 12 and details["finish_reason"] == "length"
    # Each served token's log-probability, against transformers' bf16 forward over the same tokens.
    reference = _reference(tiny_model, prompt_ids + [t["id"] for t in tokens], torch.bfloat16)
    for k, token in enumerate(tokens):
        expected = reference[len(prompt_ids) - 1 + k, token["id"]].item()
        assert token["logprob"] == pytest.approx(expected, abs=LOGPROB_TOLERANCE), (k, token)
