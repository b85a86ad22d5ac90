"""sentence-transformers' files beside a checkpoint (modules.json, 1_Pooling/config.json), as an embedding model
ships them: what conveyor/pooling.py reads and what SentenceTransformer loads."""

from __future__ import annotations

import json
from pathlib import Path


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
