"""An embedding checkpoint built offline: the demo model's weights with sentence-transformers' files beside them
(modules.json, 1_Pooling/config.json, as an embedding model ships them), which conveyor/pooling.py reads and
SentenceTransformer and vLLM load. The tests make their tiny embedders with it; the embeddings benchmark
(benchmarks/embeddings.py) its Qwen3-style one at a size people serve.
"""

from __future__ import annotations

import json
from pathlib import Path

from conveyor import demo_model

# Qwen3-Embedding's pooling: the last token's hidden state, normalized.
LAST_TOKEN = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}


def write_pooling_files(model_dir: Path, pooling: dict[str, bool], normalize: bool, dimension: int) -> Path:
    """`pooling`: 1_Pooling/config.json's mode flags; `normalize` adds the Normalize module."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": dimension, **pooling}))
    return model_dir


def ensure(out_dir: Path, size: str = "small", seed: int = 0) -> Path:
    """A random-weight Qwen3 embedder of the demo `size` (`small`: width 768, 12 layers, 32k vocabulary), pooled
    as Qwen3-Embedding is; built once into `out_dir`."""
    model_dir = demo_model.ensure(out_dir, size, seed=seed, arch="qwen3")
    if not (model_dir / "modules.json").exists():
        hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        write_pooling_files(model_dir, LAST_TOKEN, normalize=True, dimension=hidden)
    return model_dir
