"""benchmarks/accuracy.py reads llama-perplexity's KL summary (llama.cpp is not installed here: its own output, as
one run of `--kl-divergence -ctk q8_0 -ctv q8_0` printed it, stands in)."""

from __future__ import annotations

import pytest

from benchmarks import accuracy

OUTPUT = """\
chunk    PPL    ln(PPL(Q)/PPL(base))    KL Divergence    Δp RMS    Same top p
   1      28.4813 ±    4.7710       0.00258 ±    0.00133       0.00020 ±    0.00001     0.302 ±  0.031 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  20.733894 ±   1.526783
Mean PPL(base)                :  20.725043 ±   1.526222
Cor(ln(PPL(Q)), ln(PPL(base))): 100.00%
Mean ln(PPL(Q)/PPL(base))     :   0.000427 ±   0.000595
Mean PPL(Q)/PPL(base)         :   1.000427 ±   0.000595
Mean PPL(Q)-PPL(base)         :   0.008851 ±   0.012349

====== KL divergence statistics ======
Mean    KLD:   0.000200 ±   0.000006
Maximum KLD:   0.001654
99.9%   KLD:   0.001499
99.0%   KLD:   0.000989
Median  KLD:   0.000141

====== Token probability statistics ======
Same top p: 98.902 ± 0.292 %
"""


def test_the_kl_summary_becomes_scores() -> None:
    scores = accuracy.parse_llamacpp(OUTPUT, 1275)
    assert scores == accuracy.Scores(accuracy.LLAMACPP_KV_MODE, 1275, 20.733894, 0.0002, 0.000989, 0.001654, 0.98902)
    assert accuracy.LLAMACPP_KV_MODE in accuracy.table([scores])


def test_a_summary_without_its_figures_is_an_error() -> None:
    with pytest.raises(ValueError, match="kl_max"):
        accuracy.parse_llamacpp(OUTPUT.replace("Maximum KLD", "Max KLD"), 1275)
