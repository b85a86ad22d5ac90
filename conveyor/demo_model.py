"""Builds Conveyor's demo and test models offline.

Model hubs are unreachable where Conveyor is developed and tested, so the project writes its own models: a
Llama-architecture network with seeded random weights and a byte-level BPE tokenizer trained on text that
ships with Python itself (the standard library's sources). The output is an ordinary Hugging Face model
directory, loaded through exactly the code path any real model directory takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from conveyor.paths import build_once

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]  # ids 0..3, in this order

# A plain role-tagged template. It writes its own BOS, as real chat templates do, so a rendered prompt is
# tokenized without adding special tokens. Tools, tool calls and tool results are written the way Hermes-style
# models (Qwen 2.5, Hermes, many others) write them: the tools' JSON in a system turn, each call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>; that is the format the router parses calls from.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call these tools. To call one, write "
    '<tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.\n<tools>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>" + EOS + "\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}" + EOS + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The image-text demos' template: a message's content is text, or a list of parts as transformers' processors
# take them, where an image part is written as its placeholder (`<start_of_image>` as Gemma 3's own template writes
# it, `<image>` as SmolVLM's does), which the processor (and the router) expand to the image's tokens.
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# SmolVLM's (Idefics3's) image tokens, as its tokenizer has them: each tile's `<image>` run opens with the fake
# token and the tile's `<row_i_col_j>` (the whole image, small: `<global-img>`), up to 6 x 6 tiles.
FAKE, IDEFICS_IMAGE, GLOBAL_IMAGE = "<fake_token_around_image>", "<image>", "<global-img>"
IDEFICS3_TOKENS = (FAKE, IDEFICS_IMAGE, "<end_of_utterance>", GLOBAL_IMAGE) + tuple(
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
)


def image_chat_template(placeholder: str) -> str:
    """The demo's role-tagged template, with list contents whose image parts are written as `placeholder`."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + placeholder + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}" + EOS + "\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


IMAGE_CHAT_TEMPLATE = image_chat_template(BOI)


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    # Larger than the usual 0.02 for the tiny model, so its logits are spread and greedy choices are never
    # near-ties: the oracle tests compare token ids exactly.
    initializer_range: float
    corpus_bytes: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(1024, 64, 128, 2, 4, 2, 1024, 0.1, 1_000_000),
    "small": ModelSize(32000, 768, 2048, 12, 12, 4, 2048, 0.02, 5_000_000),
    # Llama 3.2 1B's shape (width 2048, 16 layers, 32 heads over 8 KV heads, MLP 8192) on the demo tokenizer: 1.1B
    # parameters, 4.4 GB in float32. For speed at the size people serve; its random weights say nothing of quality.
    "1b": ModelSize(32000, 2048, 8192, 16, 32, 8, 4096, 0.02, 5_000_000),
}


def training_corpus(max_bytes: int) -> list[str]:
    """Python's own standard library sources, in a fixed order, so the tokenizer is the same on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, corpus_bytes: int, image_tokens: tuple[str, ...] = ()):
    """`image_tokens`: an image-text demo's image tokens take the vocabulary's last ids, in order (the BPE is
    trained that many tokens short), where its config puts them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(image_tokens),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(corpus_bytes), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    if image_tokens:
        tok.add_special_tokens([AddedToken(t, special=True) for t in image_tokens])
    return tok


def _progress(message: str) -> None:
    """Building the small model takes a while: say what is happening, whatever the log level."""
    print(f"conveyor-demo-model: {message}", file=sys.stderr, flush=True)


def _template_into_tokenizer_config(out_dir: Path, arch: str = "llama") -> None:
    """Keeps the chat template in tokenizer_config.json, where every transformers version and TGI look for it
    (transformers 5 writes it to a separate chat_template.jinja instead). An image-text model's processor reads
    chat_template.jinja: it keeps the same template there."""
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template = _chat_template(arch)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if arch in IMAGE_ARCHITECTURES:
        (out_dir / "chat_template.jinja").write_text(template)
    else:
        (out_dir / "chat_template.jinja").unlink(missing_ok=True)


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gemma3-multimodal", "idefics3")
# Built with a processor (image parts, image tokens, pixel values): each one's image tokens, the vocabulary's last.
IMAGE_TOKENS = {"gemma3-multimodal": (BOI, EOI, IMAGE), "idefics3": IDEFICS3_TOKENS}
IMAGE_ARCHITECTURES = tuple(IMAGE_TOKENS)
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 28, 14, 4  # a 2x2 patch grid, one soft token per patch
# SmolVLM's tiles: 56 x 56 pixels, a 4 x 4 patch grid pixel-shuffled by 2 into 4 tokens; an image is resized to at
# most 112 pixels a side and split into up to 2 x 2 tiles, then the whole image at one tile's size.
TILE_SIZE, LONGEST_EDGE, SCALE_FACTOR = 56, 112, 2
PHI3_ORIGINAL_CONTEXT = 100  # tokens: LongRoPE's switch, between the test prompts' lengths
MISTRAL_WINDOW = 16  # tokens: shorter than the test prompts with their generations, so the window really slides


def _chat_template(arch: str) -> str:
    if arch == "idefics3":
        return image_chat_template(IDEFICS_IMAGE)
    return IMAGE_CHAT_TEMPLATE if arch in IMAGE_ARCHITECTURES else CHAT_TEMPLATE


def _model(arch: str, config_fields: dict, initializer_range: float):
    """A freshly initialised network. Qwen2's q/k/v biases start at zero in transformers and Qwen3's q/k norm
    weights at one; they get random values here so that a model built to test them really has them to handle.
    Qwen3's head size is set apart from hidden / heads (twice it), as Qwen3 checkpoints do."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**config_fields))
    if arch == "phi3":
        return _phi3(config_fields)
    if arch in ("gemma2", "gemma3"):
        return _gemma(arch, config_fields)
    if arch == "gemma3-multimodal":
        return _gemma3_multimodal(config_fields)
    if arch == "idefics3":
        return _idefics3(config_fields)
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**config_fields, sliding_window=MISTRAL_WINDOW))
    if arch == "qwen3":
        head_dim = 2 * config_fields["hidden_size"] // config_fields["num_attention_heads"]
        model = Qwen3ForCausalLM(Qwen3Config(**config_fields, head_dim=head_dim))
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.normal_(1.0, 0.2)
        return model
    model = Qwen2ForCausalLM(Qwen2Config(**config_fields))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, initializer_range)
    return model


def _gemma(arch: str, config_fields: dict):
    """A Gemma-2- or Gemma-3-like text network: a windowed layer (MISTRAL_WINDOW tokens) then a global one, head
    size twice hidden / heads, query_pre_attn_scalar apart from it, tied embeddings, random norm weights (Gemma's
    start at zero, i.e. a scale of one). Gemma 3: a local and a global rope; Gemma 2: one rope, and soft caps
    small enough to bite on these scores and logits."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    layers = config_fields["num_hidden_layers"]
    fields = {
        **config_fields,
        "head_dim": 2 * config_fields["hidden_size"] // config_fields["num_attention_heads"],
        "query_pre_attn_scalar": 24,
        "sliding_window": MISTRAL_WINDOW,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": True,
    }
    if arch == "gemma2":
        fields.pop("rope_parameters")
        capped = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0}
        model = Gemma2ForCausalLM(Gemma2Config(**fields, **capped))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**fields))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    return model


def _gemma3_multimodal(config_fields: dict):
    """Gemma 3 as its 4B and larger checkpoints ship: the text network of `_gemma("gemma3")` inside the
    image-text wrapper (`model_type` gemma3, text weights under `language_model.`), with a one-layer vision tower
    that text requests never run. The image tokens take the vocabulary's last ids."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = _gemma("gemma3", config_fields)
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    last = config_fields["vocab_size"] - 1
    wrapper = Gemma3Config(
        text_config=text.config.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=last,
        boi_token_index=last - 2,
        eoi_token_index=last - 1,
    )
    model = Gemma3ForConditionalGeneration(wrapper)
    model.model.language_model.load_state_dict(text.model.state_dict())
    with torch.no_grad():  # the projector starts at zero, which would make every image the same
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0.0, 0.3)
    return model


def _idefics3(config_fields: dict):
    """SmolVLM as it ships (`model_type` idefics3): the Llama text network of the `llama` demo under
    `model.text_model.`, a one-layer SigLIP-style tower over TILE_SIZE tiles, and the connector that pixel-shuffles
    its patches by SCALE_FACTOR and projects them. `<image>` is the image token."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    text = LlamaForCausalLM(LlamaConfig(**config_fields))
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=TILE_SIZE,
        patch_size=PATCH_SIZE,
    )
    first = config_fields["vocab_size"] - len(IDEFICS3_TOKENS)
    wrapper = Idefics3Config(
        text_config=text.config.to_dict(),
        vision_config=vision,
        scale_factor=SCALE_FACTOR,
        image_token_id=first + IDEFICS3_TOKENS.index(IDEFICS_IMAGE),
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(wrapper)
    model.model.text_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    with torch.no_grad():  # image embeddings as spread as the text's, so that another image is another answer
        model.model.connector.modality_projection.proj.weight.normal_(0.0, 0.05)
    return model


def _processor(arch: str, tokenizer):
    """The image-text demo's processor. Gemma 3's: its image processor at the vision tower's size (Gemma 3's own
    normalisation), and the soft tokens per image its config says. SmolVLM's: images resized to LONGEST_EDGE and
    split into TILE_SIZE tiles (`do_image_splitting`, as SmolVLM's checkpoints ship), 4 tokens per tile."""
    from transformers import Gemma3Processor, Idefics3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    if arch == "idefics3":
        image_processor = Idefics3ImageProcessorPil(
            size={"longest_edge": LONGEST_EDGE},
            max_image_size={"longest_edge": TILE_SIZE},
            do_image_splitting=True,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        )
        tokens = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
        return Idefics3Processor(image_processor, tokenizer, image_seq_len=tokens, chat_template=_chat_template(arch))
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    image_processor = Gemma3ImageProcessorPil(size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Gemma3Processor(image_processor, tokenizer, IMAGE_CHAT_TEMPLATE, image_seq_length=TOKENS_PER_IMAGE)


def _phi3(config_fields: dict):
    """A Phi-4-mini-like network: q/k/v and gate/up fused in the checkpoint, half of each head rotating, LongRoPE
    with distinct short and long factors and an original context of PHI3_ORIGINAL_CONTEXT tokens."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    head_dim = config_fields["hidden_size"] // config_fields["num_attention_heads"]
    rotating = head_dim // 2 // 2
    generator = torch.Generator().manual_seed(7)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": (1 + torch.rand(rotating, generator=generator)).tolist(),
        "long_factor": (1 + 8 * torch.rand(rotating, generator=generator)).tolist(),
    }
    fields = {**config_fields, "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT, "rope_parameters": rope}
    return Phi3ForCausalLM(Phi3Config(**fields))


def build(out_dir: Path, size: str = "tiny", seed: int = 0, arch: str = "llama") -> Path:
    """Writes a complete model directory to `out_dir` and returns it."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    spec = SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    images = arch in IMAGE_ARCHITECTURES
    _progress(f"training a {spec.vocab_size}-token BPE tokenizer")
    image_names = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE} if arch == "gemma3-multimodal" else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.corpus_bytes, IMAGE_TOKENS.get(arch, ())),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=spec.max_position_embeddings,
        chat_template=_chat_template(arch),
        extra_special_tokens=image_names,
    )
    tokenizer.save_pretrained(out_dir)
    if images:
        _processor(arch, tokenizer).save_pretrained(out_dir)
    _template_into_tokenizer_config(out_dir, arch)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    _progress(f"initialising a {size} {arch} model with seed {seed}")
    torch.manual_seed(seed)
    model = _model(arch, config, spec.initializer_range).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    marker = {"size": size, "seed": seed, "arch": arch, "parameters": params}
    (out_dir / "conveyor_demo.json").write_text(json.dumps(marker))
    _progress(f"wrote {out_dir} ({params / 1e6:.1f}M parameters)")
    return out_dir


def ensure(out_dir: Path, size: str = "tiny", seed: int = 0, arch: str = "llama") -> Path:
    """Builds the model unless `out_dir` already holds a finished build (the marker file is written last), once
    per machine and whole or not at all (`paths.build_once`): launchers starting together build it once, and one
    killed while building leaves nothing the next takes for a model."""
    finished = _is_built(out_dir)
    build_once(out_dir, lambda staging: build(staging, size, seed, arch), f"the {size} demo model", _is_built)
    if finished:  # a build from before the template last changed gets the new one
        _template_into_tokenizer_config(out_dir, arch)
    return out_dir


def _is_built(out_dir: Path) -> bool:
    return (out_dir / "conveyor_demo.json").exists()


DEMO_MODEL = "demo"
# The image-text demo (`--model-id demo-vision`): Gemma 3's image-text layout at the demo's size, random weights,
# built on first use as the text demo is, so that images can be tried with nothing downloaded.
DEMO_VISION_MODEL, DEMO_VISION_ARCH = "demo-vision", "gemma3-multimodal"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight Llama demo model, offline.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    args = parser.parse_args(argv)
    build(args.out_dir, args.size, args.seed, args.arch)


if __name__ == "__main__":
    main()
