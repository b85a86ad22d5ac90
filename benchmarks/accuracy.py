"""What `--quantize` and an 8-bit KV cache cost in accuracy on a real model: perplexity and KL divergence from
float32, per token.

Random-weight models have no outlier activations, so they cannot tell how much a quantization moves a real
model's answers; a real checkpoint over real text can. A fixed English text (`data/accuracy.txt`, written for this
purpose) is cut into windows of `--window` tokens, each run as one fresh prompt through the shard's own `Engine`
in-process (the model, layers and kernels a shard serves with), with logits at every position. As llama.cpp's
`llama-perplexity --kl-divergence` does, the first half of each window is context only and the second half is
scored, so every scored token sees at least half a window before it. Each quantization is reported against the
float32 model on the same tokens:

- perplexity: exp of the mean negative log-likelihood of the text's next tokens (float32's own, for scale);
- mean KL: KL(p_float32 || p_quant) over the full vocabulary, averaged over the scored tokens, with its 99th
  percentile and maximum (the rare tokens where a quantization goes wrong);
- same top-1: the share of tokens where both models' most likely next token is the same.

    python -m benchmarks.accuracy --model-id DIR --quantize int8 int4 --kv-cache-dtype int8

Then each mode's greedy answers to a few chat questions (`CHAT_QUESTIONS`), beside float32's: an average KL hides
a near tie that a quantization tips (rounding x to int8 in blocks once turned "What is the capital of France?" into
"L'Etoile, ..."), and a greedy answer shows it. `--cpu-variants` runs everything again under each kernel variant
this CPU can run (`CONVEYOR_CPU_VARIANT`, in a child process each), so every CPU kind's scores and answers stand
side by side; `--llamacpp` adds llama.cpp's q8_0 and q4_0 weights (and its q8_0 KV cache) against its own float32 on
the same text and windows, from `llama-perplexity --kl-divergence`.

`--kv-cache-dtype int8` adds the mode `kv-int8`: float32 weights over an int8 KV cache (shard/layers/kv_quant.py).
Each window is one prompt, so its tokens attend to the cache's 8-bit rows of the tokens before them, as a served
prompt does once it is cached (llama.cpp's `-ctk q8_0 -ctv q8_0` reads its cache the same way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.progress import note
from conveyor import cpu

TEXT = Path(__file__).with_name("data") / "accuracy.txt"
WINDOW = 512
# Chat questions whose greedy answers each mode gives beside float32's (tests/unit/test_real_model_accuracy.py holds
# int8's and kv-int8's to float32's opening tokens).
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a primary color.",
    "What is the largest planet in our solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'hello' into Spanish.",
    "What language is spoken in Brazil?",
)
ANSWER_TOKENS = 24
QUANTIZATIONS = ("int8", "int4")
KV_MODE = "kv-int8"  # float32 weights, --kv-cache-dtype int8


@dataclass
class Scores:
    """One mode's scores over the scored tokens; the divergences are from float32 (None for float32 itself)."""

    mode: str
    tokens: int
    perplexity: float
    mean_kl: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    same_top1: float | None = None


class Scorer:
    """One model loaded as a shard loads it (float32, or quantized), running one window at a time from an empty
    cache: full-vocabulary log-probabilities at every position."""

    def __init__(
        self, model_dir: Path, quantize: str | None, window: int, dtype: str = "float32", kv_cache_dtype: str = "auto"
    ) -> None:
        from conveyor.shard import offline

        self.engine = offline.load(model_dir, dtype, quantize, kv_cache_dtype)
        self.block_size = self.engine.block_size
        self.blocks = math.ceil(window / self.block_size)
        self.cache = self.engine.allocate(self.blocks)

    @torch.inference_mode()
    def log_probs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32: log p(next token | ids[:i + 1]) for every i, one prompt from position 0."""
        from conveyor.shard import offline

        every = torch.arange(len(ids))
        logits = offline.forward(self.engine, self.cache, [(ids, list(range(self.blocks)), 0)], every)
        return torch.log_softmax(logits.float(), dim=-1)

    def chat_prompt(self, question: str) -> list[int]:
        """One user turn in the model's chat template, ready for the assistant's answer."""
        tokenizer = self.engine.tokenizer
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return tokenizer(prompt, add_special_tokens=False).input_ids

    @torch.inference_mode()
    def greedy(self, question: str, max_new: int = ANSWER_TOKENS) -> list[int]:
        """The greedy answer's tokens to one chat question (the model's chat template), decoded a token a step
        over the cache as a shard decodes, up to `max_new` or the end of the turn."""
        from conveyor.shard import offline

        tokenizer = self.engine.tokenizer
        table, feed, length, answer = list(range(self.blocks)), self.chat_prompt(question), 0, []
        while len(answer) < max_new:
            logits = offline.forward(self.engine, self.cache, [(feed, table, length)], torch.tensor([len(feed) - 1]))
            token = int(logits[0].argmax())
            if token == tokenizer.eos_token_id:
                break
            answer.append(token)
            length, feed = length + len(feed), [token]
        return answer


def answers(scorers: dict[str, Scorer], questions: tuple[str, ...] = CHAT_QUESTIONS) -> dict[str, list[list[int]]]:
    """Each mode's greedy answer tokens to each question."""
    out = {}
    for mode, scorer in scorers.items():
        note(f"accuracy: greedy answers, {mode}")
        out[mode] = [scorer.greedy(q) for q in questions]
    return out


def answers_table(scorers: dict[str, Scorer], found: dict[str, list[list[int]]]) -> str:
    """Each question, then each mode's answer and how many of its first tokens are float32's."""
    tokenizer = scorers["float32"].engine.tokenizer
    lines = []
    for i, question in enumerate(CHAT_QUESTIONS):
        lines.append(question)
        reference = found["float32"][i]
        for mode, answer in ((m, a[i]) for m, a in found.items()):
            same = next(
                (k for k, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference))
            )
            text = tokenizer.decode(answer, skip_special_tokens=True)
            lines.append(f"  {mode:<10} {same:>2}/{len(reference):<2} same: {text!r}")
    return "\n".join(lines)


def windows(ids: list[int], window: int, limit: int | None = None) -> list[list[int]]:
    """The text's whole windows, at most `limit` (a tail shorter than a window is dropped, as llama.cpp does)."""
    count = len(ids) // window if limit is None else min(limit, len(ids) // window)
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


@dataclass
class _Tally:
    """What one mode accumulates over the windows' scored tokens."""

    nll: list[torch.Tensor]
    kl: list[torch.Tensor]
    same: list[torch.Tensor]

    @classmethod
    def empty(cls) -> _Tally:
        return cls([], [], [])

    def scores(self, mode: str) -> Scores:
        nll = torch.cat(self.nll)
        out = Scores(mode, nll.numel(), math.exp(nll.mean().item()))
        if self.kl:
            kl = torch.cat(self.kl)
            out.mean_kl, out.kl_p99, out.kl_max = kl.mean().item(), kl.quantile(0.99).item(), kl.max().item()
            out.same_top1 = torch.cat(self.same).float().mean().item()
        return out


def _score_window(
    reference: torch.Tensor, quantized: torch.Tensor, targets: torch.Tensor, tally: _Tally, is_reference: bool
) -> None:
    """Adds one window's scored rows (log-probs [n, vocab] against the next tokens `targets` [n]) to `tally`."""
    tally.nll.append(-quantized.gather(1, targets[:, None]).squeeze(1).double())
    if is_reference:
        return
    p, q = reference.double(), quantized.double()
    tally.kl.append((p.exp() * (p - q)).sum(dim=-1))
    tally.same.append(reference.argmax(dim=-1) == quantized.argmax(dim=-1))


def load(model_dir: Path, quantizations: list[str], window: int = WINDOW, kv_int8: bool = False) -> dict[str, Scorer]:
    """float32's scorer, then one per quantization, and `kv-int8`'s (float32 weights, an int8 KV cache), by mode."""
    scorers = {"float32": Scorer(model_dir, None, window)}
    for q in quantizations:
        note(f"accuracy: loading {model_dir} with --quantize {q}")
        scorers[q] = Scorer(model_dir, q, window)
    if kv_int8:
        note(f"accuracy: loading {model_dir} with --kv-cache-dtype int8")
        scorers[KV_MODE] = Scorer(model_dir, None, window, kv_cache_dtype="int8")
    return scorers


def score(
    scorers: dict[str, Scorer], text: str | None = None, window: int = WINDOW, max_windows: int | None = None
) -> list[Scores]:
    """float32's scores, then each other mode's against it, over `text` (the fixed text by default)."""
    reference = scorers["float32"]
    text = TEXT.read_text() if text is None else text
    chunks = windows(reference.engine.tokenizer(text).input_ids, window, max_windows)
    tallies = {mode: _Tally.empty() for mode in scorers}
    first = window // 2  # context only before this position (its logits predict the first scored token)
    for i, chunk in enumerate(chunks):
        note(f"accuracy: window {i + 1}/{len(chunks)}")
        targets = torch.tensor(chunk[first + 1 :])
        base = reference.log_probs(chunk)[first:-1]
        for mode, scorer in scorers.items():
            rows = base if scorer is reference else scorer.log_probs(chunk)[first:-1]
            _score_window(base, rows, targets, tallies[mode], scorer is reference)
    return [tallies[mode].scores(mode) for mode in scorers]


def compare(
    model_dir: Path,
    quantizations: list[str],
    text: str | None = None,
    window: int = WINDOW,
    max_windows: int | None = None,
    kv_int8: bool = False,
) -> list[Scores]:
    """Loads float32 and each quantization of the model, and scores them over `text` (see `score`)."""
    return score(load(model_dir, quantizations, window, kv_int8), text, window, max_windows)


LLAMACPP_KV_MODE = "llama.cpp q8_0 KV"
LLAMACPP_WEIGHTS = {"int8": "q8_0", "int4": "q4_0"}  # llama.cpp's own format of each quantization
_LLAMACPP_FIGURES = {  # llama-perplexity's summary lines: the Scores field each gives
    "Mean PPL(Q)": "perplexity",
    "Mean    KLD": "mean_kl",
    "99.0%   KLD": "kl_p99",
    "Maximum KLD": "kl_max",
    "Same top p": "same_top1",
}


def parse_llamacpp(output: str, tokens: int, mode: str = LLAMACPP_KV_MODE) -> Scores:
    """llama-perplexity --kl-divergence's summary as Scores (its "Same top p" is a percentage)."""
    found: dict[str, float] = {}
    for line in output.splitlines():
        label, _, value = line.partition(":")
        if (name := _LLAMACPP_FIGURES.get(label.rstrip())) is not None and value.split():
            found[name] = float(value.split()[0])
    missing = set(_LLAMACPP_FIGURES.values()) - set(found)
    if missing:
        raise ValueError(f"llama-perplexity printed no {', '.join(sorted(missing))}")
    found["same_top1"] /= 100
    return Scores(mode, tokens, **found)


def llamacpp(
    model_dir: Path, text: Path, window: int, windows: int, quantizations: list[str], kv_int8: bool
) -> list[Scores]:
    """llama.cpp's own q8_0 / q4_0 weights (for each of `quantizations`) and, with `kv_int8`, its q8_0 KV cache,
    each against its float32 GGUF on the same text and windows (flash attention on every run, as a quantized V cache
    needs); none where llama.cpp is not installed (make bench builds it)."""
    from benchmarks import deploy  # the peers' tools: only this comparison needs them

    server = deploy.llamacpp_server()
    if not isinstance(server, Path):
        note(f"accuracy: no llama.cpp to compare with ({server})")
        return []
    perplexity = str(server.with_name("llama-perplexity"))
    common = ["-f", str(text), "-c", str(window), "-t", str(os.cpu_count() or 1), "-fa", "on"]
    float32 = deploy.gguf(model_dir, "float32")
    runs = [(f"llama.cpp {LLAMACPP_WEIGHTS[q]}", deploy.gguf(model_dir, q), []) for q in quantizations]
    if kv_int8:
        runs.append((LLAMACPP_KV_MODE, float32, ["-ctk", "q8_0", "-ctv", "q8_0"]))
    out = []
    with tempfile.TemporaryDirectory() as folder:
        base = ["--kl-divergence-base", str(Path(folder) / "base.kld")]
        note("accuracy: llama.cpp's float32 (the base)")
        subprocess.run([perplexity, "-m", str(float32), *common, *base], check=True, capture_output=True)
        for mode, model, flags in runs:
            note(f"accuracy: {mode}")
            command = [perplexity, "-m", str(model), *common, *base, "--kl-divergence", *flags]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            out.append(parse_llamacpp(done.stdout + done.stderr, windows * (window // 2 - 1), mode))
    return out


def under_variant(variant: str, argv: list[str]) -> dict:
    """This benchmark's JSON output, run again in a child as a CPU of kind `variant` would run it (the kernel
    library, oneDNN's and ATen's ISA all capped to it, as make test's AVX2 rerun caps them)."""
    environ = dict(os.environ, CONVEYOR_CPU_VARIANT=variant)
    if variant == "avx2":
        environ.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    command = [sys.executable, "-m", "benchmarks.accuracy", *argv, "--json"]
    note(f"accuracy: every mode again as CONVEYOR_CPU_VARIANT={variant}")
    done = subprocess.run(command, env=environ, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _cell(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def table(scores: list[Scores]) -> str:
    """The scores as a fixed-width table, one mode a line."""
    lines = [
        f"{'mode':<18} {'tokens':>6} {'perplexity':>10} {'mean KL':>9} {'KL p99':>8} {'KL max':>8} {'same top-1':>10}"
    ]
    for s in scores:
        top1 = None if s.same_top1 is None else 100 * s.same_top1
        lines.append(
            f"{s.mode:<18} {s.tokens:>6} {s.perplexity:>10.4f} {_cell(s.mean_kl, '.5f'):>9} "
            f"{_cell(s.kl_p99, '.4f'):>8} {_cell(s.kl_max, '.4f'):>8} {_cell(top1, '.2f', '%'):>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Perplexity and KL divergence from float32 of quantized modes.")
    parser.add_argument("--model-id", type=Path, default=None, help="a local model directory (default: the real model)")
    parser.add_argument("--quantize", nargs="*", choices=QUANTIZATIONS, default=list(QUANTIZATIONS))
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", "int8"], default="auto", help=f"int8 adds the mode {KV_MODE}"
    )
    parser.add_argument("--text", type=Path, default=TEXT, help="the text to score (default: the fixed one)")
    parser.add_argument("--window", type=int, default=WINDOW, help="tokens per window; the second half is scored")
    parser.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON instead of a table")
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="add llama.cpp's q8_0 / q4_0 weights (and q8_0 KV cache) against its float32 on the same text",
    )
    parser.add_argument(
        "--cpu-variants",
        action="store_true",
        help="score every mode again under each kernel variant this CPU runs (CONVEYOR_CPU_VARIANT)",
    )
    args = parser.parse_args(argv)
    if args.cpu_variants:
        return by_variant([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--cpu-variants"], args)
    if args.model_id is None:
        from benchmarks.real_model import prepare

        args.model_id = prepare()
    kv_int8 = args.kv_cache_dtype == "int8"
    scorers = load(args.model_id, args.quantize, args.window, kv_int8)
    scores = score(scorers, args.text.read_text(), args.window, args.max_windows)
    if args.llamacpp and args.max_windows is None:
        windows = scores[0].tokens // (args.window // 2 - 1)  # float32's: every window's scored tokens
        scores += llamacpp(args.model_id, args.text, args.window, windows, args.quantize, kv_int8)
    found = answers(scorers)
    if args.json:
        tokenizer = scorers["float32"].engine.tokenizer
        texts = {mode: [tokenizer.decode(a) for a in each] for mode, each in found.items()}
        print(json.dumps({"scores": [asdict(s) for s in scores], "answers": found, "texts": texts}, indent=2))
    else:
        print(table(scores) + "\n\n" + answers_table(scorers, found))


def by_variant(argv: list[str], args: argparse.Namespace) -> None:
    """Every mode under each runnable kernel variant (llama.cpp, whose figures no variant changes, with the first
    only): one table of scores with the variant in each mode's name, then each question's answers per variant."""
    without_llamacpp = [a for a in argv if a != "--llamacpp"]
    variants = cpu.runnable_kinds(cpu.probe().flags)
    runs = {v: under_variant(v, argv if i == 0 else without_llamacpp) for i, v in enumerate(variants)}
    scores: list[Scores] = []
    for variant, found in runs.items():
        for row in found["scores"]:
            mine = not row["mode"].startswith("llama.cpp")
            scores.append(Scores(**{**row, "mode": f"{variant} {row['mode']}" if mine else row["mode"]}))
    if args.json:
        print(json.dumps({"by_variant": runs}, indent=2))
        return
    lines = [table(scores), ""]
    for i, question in enumerate(CHAT_QUESTIONS):
        lines.append(question)
        for variant, found in runs.items():
            for mode, answers_ in found["texts"].items():
                lines.append(f"  {variant:<12} {mode:<8} {answers_[i]!r}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
