"""What a pooling model outputs, read from its folder: the embedding size, the class labels, and
whether it scores a pair itself (a cross-encoder) or through two embeddings (a bi-encoder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.models.model_files import read_model_json

DENSE = "sentence_transformers.models.Dense"


def _json(path: Path) -> Any:
    return read_model_json(path)


def _config(folder: Path) -> dict[str, Any]:
    try:
        return _json(folder / "config.json")
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path {folder}: cannot read config.json ({e})") from None


def is_cross_encoder(folder: Path) -> bool:
    """A sequence-classification head: it scores a (query, document) pair as one input."""
    return any(a.endswith("ForSequenceClassification") for a in _config(folder).get("architectures") or [])


def embedding_dim(folder: Path) -> int:
    """The length of the model's embeddings: config.json's embedding_size, else a sentence-transformers
    Dense layer's output, else its pooling config's word_embedding_dimension, else its hidden_size."""
    override = _config(folder).get("embedding_size")  # vLLM's ModelConfig.embedding_size reads it first
    if isinstance(override, int) and not isinstance(override, bool):
        return override
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


def is_matryoshka(folder: Path) -> bool:
    """Whether the model's embeddings may be shortened (task.dimensions): vLLM's rule, from config.json."""
    config = _config(folder)
    return bool(config.get("matryoshka_dimensions")) or bool(config.get("is_matryoshka"))


def check_pooling_model(task: str, dimensions: Optional[int], folder: Path) -> None:
    """ConfigError when the model cannot do what the task asks: classify without classes,
    task.dimensions on a model without Matryoshka embeddings or above its embedding size."""
    if task == "classify":
        class_labels(folder)
    if task != "embed" or dimensions is None:
        return
    if not is_matryoshka(folder):
        raise ConfigError(
            f"task.dimensions={dimensions}: model.path {folder} does not have Matryoshka embeddings (config.json "
            f"has no matryoshka_dimensions or is_matryoshka), so vLLM refuses to shorten them; unset task.dimensions"
        )
    size = embedding_dim(folder)
    if dimensions > size:
        raise ConfigError(
            f"task.dimensions={dimensions} is above the model's embedding size {size} (model.path {folder}); "
            f"set task.dimensions={size} or less, or unset it"
        )
    listed = _config(folder).get("matryoshka_dimensions")
    if listed and dimensions not in listed:
        raise ConfigError(
            f"task.dimensions={dimensions}: model.path {folder} gives only the Matryoshka dimensions {listed} "
            f"(config.json matryoshka_dimensions), so vLLM refuses {dimensions}; choose one of them"
        )
