"""A chat template that refuses the config's own turns (a model without a system role) stops the run
at once with a config error (exit 2), before any row, instead of making every row an error row
(issue 26). The stand-in engine tokenizes with the model folder's own chat template."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.corpus import read_output, write_corpus
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError
from batchinfer.launch.local import run_local

NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
)


def no_system_model(tiny_model_path: Path, out: Path) -> Path:
    """The tiny model with a chat template that raises on a system turn (as Gemma's does)."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_path, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = NO_SYSTEM
    tok.save_pretrained(str(out))
    return out


def test_a_template_that_refuses_the_system_prompt_stops_before_any_row(tmp_path: Path, tiny_model_path: Path) -> None:
    model = no_system_model(tiny_model_path, tmp_path / "no-system")
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 10)
    cfg = compose(run_overrides(model, corpus, tmp_path / "run", "prompt.system=Be brief"))
    with pytest.raises(
        ConfigError, match=r"chat template rejects the configured turns .*System role not supported"
    ) as e:
        run_local(cfg, engine=StandinEngine(cfg))
    assert e.value.exit_code == 2
    assert not list((tmp_path / "run").glob("shards/*/part-*"))  # no row was made an error row
    # without the system prompt the same model runs every row
    cfg = compose(run_overrides(model, corpus, tmp_path / "ok"))
    out = read_output(run_local(cfg, engine=StandinEngine(cfg)).path)
    assert [r["id"] for r in out] == [r["id"] for r in rows] and all(r["error"] is None for r in out)
