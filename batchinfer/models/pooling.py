"""What a pooling model outputs, read from its folder: the embedding size, the class labels, and
whether it scores a pair itself (a cross-encoder) or through two embeddings (a bi-encoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinfer.errors import ConfigError

DENSE = "sentence_transformers.models.Dense"


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _config(folder: Path) -> dict[str, Any]:
    try:
        return _json(folder / "config.json")
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path {folder}: cannot read config.json ({e})") from None


def is_cross_encoder(folder: Path) -> bool:
    """A sequence-classification head: it scores a (query, document) pair as one input."""
    return any(a.endswith("ForSequenceClassification") for a in _config(folder).get("architectures") or [])


def embedding_dim(folder: Path) -> int:
    """The length of the model's embeddings: a sentence-transformers Dense layer's output, else
    its pooling config's word_embedding_dimension, else config.json's hidden_size."""
    modules = folder / "modules.json"
    if modules.is_file():
        for m in reversed(_json(modules)):
            path = folder / m.get("path", "") / "config.json"
            if m.get("type") == DENSE and path.is_file():
                return int(_json(path)["out_features"])
    pooling = folder / "1_Pooling" / "config.json"
    if pooling.is_file() and "word_embedding_dimension" in _json(pooling):
        return int(_json(pooling)["word_embedding_dimension"])
    config = _config(folder)
    size = config.get("hidden_size") or config.get("d_model")
    if not size:
        raise ConfigError(f"model.path {folder}: config.json has no hidden_size to size the embedding column")
    return int(size)


def class_labels(folder: Path) -> list[str]:
    """The classifier's label names in class-index order (id2label; LABEL_i when it has none)."""
    config = _config(folder)
    id2label = config.get("id2label") or {}
    n = len(id2label) or int(config.get("num_labels") or 0)
    if not n:
        raise ConfigError(
            f"model.path {folder}: config.json names no classes (id2label, num_labels): task=classify needs "
            f"a sequence-classification model"
        )
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]
