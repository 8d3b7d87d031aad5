"""attack (H2, H3, M4): a secret-named key inside a dict's text in an override or a --try (Hydra's
echo of an unreadable value, the tune folder keeping a parsed dict as typed), and the way out of the
refusal of an older run.yaml whose `<redacted>` is the user's own text."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer.config.compose import apply_overrides, compose, secret_keys_inside
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch.local import run_task
from batchinfer.redaction import REDACTED, redact_printed
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir
from batchinfer.tune.settings import parse_tries

SECRET = "SEKRITx9q7"


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("cluster.env={HF_TOKEN:SEKRITx9q7{}", "HF_TOKEN"),  # `no viable alternative at input '{HF_TOKEN:SEKRITx9q7{'`
        ("+cluster.env={HF_TOKEN:SEKRITx9q7[}", "HF_TOKEN"),
        ("+cluster={env:{HF_TOKEN:SEKRITx9q7{}}", "env.HF_TOKEN"),
        ("model.lora.adapters={x:/a/b,HF_TOKEN:SEKRITx9q7{}", "HF_TOKEN"),
        ("model.lora.adapters={x:/a/b,'API_KEY':SEKRITx9q7{}", "API_KEY"),
    ],
)
def test_a_dict_naming_a_secret_key_that_hydra_cannot_parse_echoes_no_piece_of_it(
    override: str, path: str, tmp_path: Path
) -> None:
    """H3: Hydra's parse error echoed the dict's text, the secret beside its key. Refused naming the
    override's key, the secret-named key inside and the dot form; compose (run, validate, tune's
    trials) and apply_overrides (resume's and redo's overrides) alike."""
    key = override.partition("=")[0].lstrip("+")
    base = [f"input.path={tmp_path / 'in.jsonl'}", "model.path=/nonexistent"]
    with pytest.raises(ConfigError) as refused:
        compose([*base, override])
    said = str(refused.value)
    assert said.startswith(f"{key}: Hydra's override grammar cannot read the value given (not shown: it holds {path}")
    assert f"\"+{key}.{path}='...'\"" in said and "SEKRIT" not in said and "SEKRIT" not in redact_printed(said)
    with pytest.raises(ConfigError) as refused:
        apply_overrides(compose(base[:1] + ["model.path=/x"]), [override])
    assert str(refused.value) == said


def test_a_dict_without_a_secret_keeps_hydras_message() -> None:
    assert secret_keys_inside("{x:/a/b,y:2}") == []
    with pytest.raises(ConfigError, match=r"no viable alternative at input '\{x:/a/b,y\{'"):
        compose(["model.lora.adapters={x:/a/b,y{}"])


@pytest.mark.parametrize(
    "word",
    [
        "+cluster.env={HF_TOKEN:SEKRITplus8}",  # the tune folder kept it as typed: tune.md, spec.json, best.yaml
        "cluster.env={HF_TOKEN:SEKRITplus8}",
        "+cluster={env:{HF_TOKEN:SEKRITplus8}}",
        "cluster.env={HF_TOKEN:SEKRITplus8{}",  # one Hydra cannot parse: refused as compose refuses it
    ],
)
def test_a_try_giving_a_secret_in_a_dict_is_refused_naming_the_dot_form(word: str) -> None:
    """H2: `--try '+cluster.env={HF_TOKEN:X}'` wrote X to the console, tune.md, tune.json, best.yaml
    and each trial's spec.json (the dot form's value is struck there and travels by environment)."""
    with pytest.raises(ConfigError) as refused:
        parse_tries([f"model.max_num_seqs=8 {word}"])
    said = str(refused.value)
    key = word.partition("=")[0].lstrip("+")
    assert said.startswith(f"--try {key}: ") and "HF_TOKEN" in said and "SEKRIT" not in said
    assert "+cluster.env.HF_TOKEN=" in said
    (dot,) = parse_tries(["model.max_num_seqs=8 +cluster.env.HF_TOKEN=SEKRITplus8"])  # the way it says
    assert dot.overrides == ("model.max_num_seqs=8", "+cluster.env.HF_TOKEN=SEKRITplus8")


def test_an_older_run_yaml_whose_redacted_is_the_users_own_text_runs_once_marked_exact(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """M4: an older run.yaml whose prompt holds `<redacted>` the user typed was refused with no way
    out. The refusal says to add `redaction: exact` to run.yaml; with it the array tasks (what resume
    submits) run the text as typed."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "r{i}", "text": "hello {i}"}}\n' for i in range(4)))
    template = f"Mask names as {REDACTED}: {{text}}"
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "old", f"prompt.template={template}"))
    run = prepare(cfg)
    record = yaml.safe_load(run.run_yaml.read_text())
    record.pop("redaction")  # as a version before the exact records wrote it
    run.run_yaml.write_text(yaml.safe_dump(record, sort_keys=False))
    with pytest.raises(RunDirError) as refused:
        run_task(str(run.path), 0, engine=StandinEngine(cfg))
    assert f"add the line `redaction: exact` to {run.path}/run.yaml" in str(refused.value)
    with run.run_yaml.open("a") as f:  # what the message says to do
        f.write("redaction: exact\n")
    assert RunDir(run.path).config.prompt.template == template
    run_task(str(run.path), 0, engine=StandinEngine(cfg))
    assert all(RunDir(run.path).shard_folder(s.index).is_done() for s in RunDir(run.path).shards())


@pytest.mark.parametrize(
    "override",
    [
        "cluster.env={X:${oc.env:HF_TOKEN,SEKRITq9x7}{}",  # `no viable alternative at input '{X:${oc.env:...`
        "+cluster.env.X=${oc.env:HF_TOKEN,SEKRITq9x7}{",  # `Error parsing override '+cluster.env.X=...`
    ],
)
def test_the_default_of_a_secret_env_reference_is_a_secret_in_a_parse_error(override: str, tmp_path: Path) -> None:
    """H3: the default of ${oc.env:HF_TOKEN,X} stands in for the token; Hydra's parse error echoed it."""
    key = override.partition("=")[0].lstrip("+")
    with pytest.raises(ConfigError) as refused:
        compose([f"input.path={tmp_path / 'in.jsonl'}", "model.path=/x", override])
    said = str(refused.value)
    assert said.startswith(f"{key}: Hydra's override grammar cannot read the value given (not shown: it holds the ")
    assert "${oc.env:HF_TOKEN,...}" in said and "SEKRIT" not in said
    # and a printed line holding one (Hydra's own echo) is struck
    echo = f"Error parsing override '{override}'"
    assert redact_printed(echo) == echo.replace("SEKRITq9x7", REDACTED)


@pytest.mark.parametrize("override", ["cluster.env={ＨＦ_TOKEN:SEKRITq9x7{}", "cluster.env={ＨＦ_TOKEN:SEKRITq9x7}"])
def test_a_value_hydras_lexer_cannot_read_is_not_echoed(override: str) -> None:
    """H3b: a fullwidth key made Hydra echo the whole override (LexerNoViableAltException)."""
    with pytest.raises(ConfigError) as refused:
        compose(["model.path=/x", override])
    said = str(refused.value)
    assert said.startswith("cluster.env: Hydra's override grammar cannot read the value given (a character its lexer")
    assert "SEKRIT" not in said and "ＨＦ" not in said


@pytest.mark.parametrize(("line", "shown"), [("EXACT", "EXACT"), ("true", "true"), ("'yes'", "yes")])
def test_a_redaction_line_of_another_value_is_named_not_asked_for(line: str, shown: str, tmp_path: Path) -> None:
    """L3: with `redaction: EXACT` (or true) in run.yaml, the refusal asked to add a line that is there."""
    from batchinfer.rundir.store import refuse_struck

    record = yaml.safe_load(f"redaction: {line}\nconfig:\n  prompt:\n    template: 'Mask as {REDACTED}: {{text}}'\n")
    with pytest.raises(RunDirError) as refused:
        refuse_struck(tmp_path, record)
    said = str(refused.value)
    assert f"change the line `redaction: {shown}` of {tmp_path}/run.yaml to `redaction: exact`" in said
    assert "add the line" not in said
