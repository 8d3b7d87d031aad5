"""Issue 42, records read back and printed lines: what a printed line keeps around a struck value, old
run directories whose run.yaml holds struck free text, refusals that would show two identical struck
texts, and the records a redo or a tune reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.corpus import write_corpus
from support.fake_engine import fake_overrides
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer import cli
from batchinfer.config.compose import apply_overrides, compose
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch import slurm
from batchinfer.launch.local import run_local, run_task
from batchinfer.launch.redo import redo
from batchinfer.launch.submit import apply_resource_overrides, submit_shards
from batchinfer.redaction import REDACTED, record_yaml, redact_printed, redact_text
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir
from batchinfer.tune import results
from batchinfer.tune.settings import Setting, parse_tries

TEMPLATE = "Sort by key={key}: {text}"


def key_corpus(path: Path) -> Path:
    """Rows with a column named `key`, which a template names as `key={key}`."""
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": f"hello {i}", "key": f"k{i}"}) + "\n" for i in range(6)))
    return path


def test_a_struck_value_keeps_the_quote_that_closes_it_and_a_placeholder_is_no_secret() -> None:
    # `--cfg job` and `status` printed `'token=<redacted>` (the closing quote eaten) and `key=<redacted>}`
    # for a template's `key={key}` placeholder
    line = "use key={key} or key={{key}} and 'token=abc' now --token 'x y' --api-key=k1\" end"
    assert redact_text(line) == (
        f"use key={{key}} or key={{{{key}}}} and 'token={REDACTED}' now --token {REDACTED} --api-key={REDACTED}\" end"
    )
    assert redact_printed('say "api_key=xyz" ok') == f'say "api_key={REDACTED}" ok'
    # a quote never closed (a parse error's echo) opens a value up to a space
    assert redact_text("error: HF_TOKEN='ab3 here") == f"error: HF_TOKEN={REDACTED} here"
    assert redact_text("error: --token 'cd4") == f"error: --token {REDACTED}"
    printed = record_yaml({"prompt": {"template": "use key={key} and 'token=abc' now", "system": 'say "pass=xyz" ok'}})
    assert f"template: use key={{key}} and 'token={REDACTED}' now\n" in printed
    assert f'system: say "pass={REDACTED}" ok\n' in printed
    assert "abc" not in printed and "xyz" not in printed


def _as_an_older_version_wrote_it(run: RunDir, **struck: str) -> None:
    """run.yaml as a version before the exact records wrote it: no `redaction` mark, and the given
    config keys (prompt.template=...) holding the text its redaction struck, fingerprint keys too."""
    record = yaml.safe_load(run.run_yaml.read_text())
    record.pop("redaction", None)
    for key, value in struck.items():
        group, name = key.split("__")
        record["config"][group][name] = yaml.safe_load(value) if value.startswith("[") else value
        if f"{group}.{name}" in record["fingerprint_keys"]:
            record["fingerprint_keys"][f"{group}.{name}"] = record["config"][group][name]
    run.run_yaml.write_text(yaml.safe_dump(record, sort_keys=False))


def test_an_older_run_yaml_with_struck_free_text_is_refused_where_it_would_run(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """K7: a run.yaml an older version wrote with `token=<redacted>` in prompt.template (typed
    `token=t0k3n-abc`) ran that text in every task, resume and redo without a word. Refused, naming
    DIR, the key and what to do; status still reads it."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    cfg = compose(
        run_overrides(tiny_model_path, corpus, tmp_path / "old", "prompt.template=Use token=t0k3n-abc: {text}")
    )
    run = prepare(cfg)
    _as_an_older_version_wrote_it(run, prompt__template=f"Use token={REDACTED}: {{text}}")
    with pytest.raises(RunDirError) as refused:
        run_task(str(run.path), 0, engine=StandinEngine(cfg))  # what an array task, resume's and redo's, run
    msg = str(refused.value)
    assert "\n" not in msg and f"{run.path}/run.yaml" in msg and "prompt.template" in msg
    assert "new output.dir" in msg and "prompt.template changes outputs" in msg
    assert not list(run.shards_dir.glob("*/*.parquet")) and not list(run.shards_dir.glob("*/*.jsonl"))
    with pytest.raises(RunDirError, match="prompt.template"):
        redo(str(run.path), "row < 2", [])
    assert cli.main(["status", str(run.path)]) == 0  # status reads it, and says what its tasks would refuse
    shown = capsys.readouterr()
    assert "pending" in shown.out and f"warning: {run.path}/run.yaml was written by an older batchinfer" in shown.err


def test_an_older_run_yaml_struck_in_a_setting_says_resume_gives_it_again(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """K7: a key resume accepts (cluster.setup) struck by an older version: resume DIR KEY=... mends it."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    run = prepare(compose(run_overrides(tiny_model_path, corpus, tmp_path / "old")))
    _as_an_older_version_wrote_it(run, cluster__setup=f"['wandb login --token {REDACTED}', 'module load cuda']")
    with pytest.raises(RunDirError) as refused:
        RunDir(run.path).config  # noqa: B018
    assert f"`batchinfer resume {run.path} cluster.setup=...`" in str(refused.value)
    old = RunDir(run.path)
    apply_resource_overrides(old, ["cluster.setup=['module load cuda']"])
    assert RunDir(run.path).config.cluster.setup == ["module load cuda"]


def test_typed_redacted_text_in_a_prompt_runs_as_typed(tmp_path: Path, tiny_model_path: Path) -> None:
    """The mark tells the user's own `<redacted>` (a prompt asking to mask names) from an older
    version's strike; a reopen of an unmarked run.yaml composed the same marks it."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    template = f"Mask names as {REDACTED} in key={REDACTED}: {{text}}"
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "new", f"prompt.template={template}"))
    run = prepare(cfg)
    assert yaml.safe_load(run.run_yaml.read_text())["redaction"] == "exact"
    assert RunDir(run.path).config.prompt.template == template
    _as_an_older_version_wrote_it(run)
    with pytest.raises(RunDirError, match="prompt.template"):
        RunDir(run.path).config  # noqa: B018
    prepare(cfg)  # the same command again: what it composes is what the user typed
    assert RunDir(run.path).config.prompt.template == template


def test_a_different_config_inside_a_struck_part_is_said_not_shown_twice(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """K8: reopening DIR with a prompt that differs only after `token=` printed the refusal with two
    identical struck texts (`'Use token=<redacted>' -> 'Use token=<redacted>'`)."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    out = tmp_path / "run"
    prepare(compose(run_overrides(tiny_model_path, corpus, out, "prompt.template={text} token=aaaa1111")))
    other = compose(run_overrides(tiny_model_path, corpus, out, "prompt.template={text} token=bbbb2222"))
    with pytest.raises(RunDirError) as refused:
        prepare(other)
    printed = redact_printed(str(refused.value))  # as the console prints it
    assert "prompt.template (differs in a redacted part)" in printed
    assert "aaaa1111" not in printed and "bbbb2222" not in printed
    # a difference outside the struck part is shown, the struck part struck
    prepare(compose(run_overrides(tiny_model_path, corpus, tmp_path / "b", "prompt.template={text} a token=aaaa1111")))
    with pytest.raises(RunDirError) as refused:
        prepare(
            compose(run_overrides(tiny_model_path, corpus, tmp_path / "b", "prompt.template={text} b token=aaaa1111"))
        )
    assert f"('{{text}} a token={REDACTED}' -> '{{text}} b token={REDACTED}')" in redact_printed(str(refused.value))


def test_a_where_holding_a_secrets_value_is_refused_before_pass_json_keeps_it(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K5: `redo DIR --where EXPR` with a secret variable's value in EXPR: pass.json keeps the --where as
    typed (a resume and the same redo run it), so the secret was stored. Refused, as compose refuses a
    secret's value in a config value, naming --where and the variable, not the value."""
    monkeypatch.setenv("PROJECT_TOKEN", "sharedproj01")
    corpus = key_corpus(tmp_path / "k.jsonl")
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run"))
    run = run_local(cfg, engine=StandinEngine(cfg))
    with pytest.raises(ConfigError) as refused:
        redo(str(run.path), 'text != "sharedproj01"', [], engine=StandinEngine(cfg))
    assert "--where holds the value of PROJECT_TOKEN, a secret (12 characters)" in str(refused.value)
    assert "sharedproj01" not in str(refused.value)
    # a password typed in the redo's own overrides counts too
    with pytest.raises(ConfigError, match="--where holds the value of DB_PASS, a secret"):
        redo(
            str(run.path), 'text != "pw-typed-here"', ["+cluster.env.DB_PASS=pw-typed-here"], engine=StandinEngine(cfg)
        )
    assert not (run.path / "passes").exists() or not any((run.path / "passes").iterdir())
    redo(str(run.path), 'text != "sharedproj"', [], engine=StandinEngine(cfg))  # no secret: runs
    assert "sharedproj" in json.loads((run.path / "passes" / "1" / "pass.json").read_text())["where"]


def test_a_try_holding_a_secrets_value_is_refused_before_the_tune_folder_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """K10: a --try value under a key that is no secret's (prompt.system, env.PLAIN, also as a
    reference it resolves to) is kept as typed in job.json and each trial's spec.json; one holding a
    secret's value was stored there, the trial's compose refusing it only after. Refused at parse,
    as compose refuses it, naming the --try key and the variable; a secret-named env.NAME is no
    such value (it travels in the environment)."""
    monkeypatch.setenv("PROJECT_TOKEN", "sharedproj01")
    for word in ("prompt.system=x-sharedproj01", "env.PLAIN=sharedproj01", "env.PLAIN=${oc.env:PROJECT_TOKEN}"):
        with pytest.raises(ConfigError) as refused:
            parse_tries([f"model.max_num_seqs=8 {word}"])
        key = word.partition("=")[0]
        assert f"--try {key} holds the value of PROJECT_TOKEN, a secret (12 characters)" in str(refused.value)
        assert "sharedproj01" not in str(refused.value)
    with pytest.raises(ConfigError, match="--try model.engine_kwargs.dsn_url holds a URL with a password"):
        parse_tries(["model.engine_kwargs.dsn_url=postgres://app:pw-1234@db/x"])
    (kept,) = parse_tries(["model.max_num_seqs=8 env.HF_TOKEN=sharedproj01 env.PLAIN=sharedproj"])
    assert kept.env == {"HF_TOKEN": "sharedproj01", "PLAIN": "sharedproj"}


def test_best_yaml_holds_the_winners_environment_as_it_runs(tmp_path: Path, tiny_model_path: Path) -> None:
    """K11: conf/tuned/best.yaml, read back by `run --config-dir TUNE/conf +tuned=best`, was written
    by the text redaction: an env.NAME that is no secret lost its text (`http://<redacted>@proxy`),
    so the run took another value than the trial measured. Exact but a secret-named key's value."""
    winner = Setting(
        ("model.max_num_seqs=8",),
        {"HTTPS_PROXY": "http://proxyuser@proxy.example:3128", "HF_TOKEN": "hf_secretvalue1"},
    )
    group = results.write_group(tmp_path / "tune", winner.override_strings())
    text = group.read_text()
    assert "HTTPS_PROXY: http://proxyuser@proxy.example:3128\n" in text
    assert f"HF_TOKEN: {REDACTED}\n" in text and "hf_secretvalue1" not in text


@pytest.mark.parametrize(
    "override",
    [
        "+cluster.env.HF_TOKEN=ab{",  # Hydra echoed the override whole
        "+cluster.env.HF_TOKEN=[ab1",  # ... or the part where it stopped: `no viable alternative at input '[ab1'`
        "+cluster.env.HF_TOKEN=a,b2{",  # ... a list's first item struck, the rest shown
        "+cluster.env.HF_TOKEN='ab3",  # a quote never closed
        "model.engine_kwargs.api_key=[ab4",
        '+cluster.env.HF_TOKEN=${oc.decode:"{a: hf_ab5}"}',  # attack42b: the lexer's echo
        "+cluster.env.API_KEY=ab(cd)ef6",  # attack42b: "extraneous input 'ef6'"
    ],
)
def test_an_override_hydra_cannot_parse_echoes_no_piece_of_a_secret(override: str, tmp_path: Path) -> None:
    """K14: a Hydra grammar error in an override holding a secret printed the override or the part of
    the value where the parser stopped; the error now names the key and how to write the value."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as refused:
        compose([f"input.path={tmp_path / 'in.jsonl'}", "model.path=/nonexistent", override])
    printed = redact_printed(str(refused.value))
    assert printed.startswith(f"{key.lstrip('+')}: Hydra's override grammar cannot read the value given")
    assert f"\"{key}='...'\"" in printed
    for piece in ("ab1", "b2", "ab3", "ab4", "hf_ab5", "ef6"):
        assert piece not in printed
    with pytest.raises(ConfigError) as refused:  # resume's and redo's overrides, on a config
        apply_overrides(compose([f"input.path={tmp_path / 'in.jsonl'}", "model.path=/x"]), [override])
    assert str(refused.value).startswith(f"{key.lstrip('+')}: Hydra's override grammar cannot read")


def test_a_parse_error_in_an_override_holding_no_secret_is_hydras() -> None:
    with pytest.raises(ConfigError, match=r"Error parsing override 'model.max_num_seqs=a\{'"):
        compose(["model.max_num_seqs=a{"])


def test_a_dry_run_refuses_a_secret_this_shell_lacks_as_the_submission_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """K13: `submit --dry-run` / `resume --dry-run` planned and printed as if all was well when a
    secret the jobs take from this shell was missing (cluster.env_inherit's, a struck cluster.env
    entry at resume); the real submission refused. The dry run refuses it the same way."""
    monkeypatch.setattr(slurm, "max_array_size", lambda: 1001)  # no cluster needed for a dry run
    monkeypatch.delenv("NOT_SET_TOKEN", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-0123")
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    inherit = prepare(
        compose(fake_overrides(tmp_path / "a", corpus, "cluster=slurm", "cluster.env_inherit=[NOT_SET_TOKEN]"))
    )
    with pytest.raises(ConfigError, match="cluster.env_inherit names NOT_SET_TOKEN, which is not set in this shell"):
        submit_shards(RunDir(inherit.path), [0], dry_run=True)
    assert "job name" not in capsys.readouterr().out
    stored = prepare(
        compose(fake_overrides(tmp_path / "b", corpus, "cluster=slurm", "+cluster.env.WANDB_API_KEY=wandb-key-0123"))
    )
    submit_shards(RunDir(stored.path), [0], dry_run=True)  # this shell has it: planned
    assert "job name" in capsys.readouterr().out
    monkeypatch.delenv("WANDB_API_KEY")  # a resume from a shell without it: run.yaml holds it struck
    with pytest.raises(ConfigError, match=r"cluster.env.WANDB_API_KEY is a secret.*`export WANDB_API_KEY=\.\.\.`"):
        submit_shards(RunDir(stored.path), [0], dry_run=True)


def test_a_relative_path_is_checked_for_a_secrets_value_as_run_yaml_holds_it(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K9: the by-value refusal checked input.path as typed (`k.jsonl`), and run.yaml holds it
    resolved (`/.../wsekr3tvalue9w/k.jsonl`): a folder named with a secret's value was stored."""
    monkeypatch.setenv("MY_SVC_TOKEN", "sekr3tvalue9")
    here = tmp_path / "wsekr3tvalue9w"
    here.mkdir()
    key_corpus(here / "k.jsonl")
    monkeypatch.chdir(here)
    cfg = compose(run_overrides(tiny_model_path, Path("k.jsonl"), tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"input.path holds the value of MY_SVC_TOKEN, a secret \(12 characters\)"):
        prepare(cfg)
    assert not (tmp_path / "out").exists()


def test_resumes_type_errors_name_the_key_and_echo_no_secret(tmp_path: Path) -> None:
    """resume's (and redo's) overrides on the frozen config: a type error named no key, and one for a
    secret-named key echoed its value (`Cannot convert 'list' to string: '[hf_ab6, 2]'`)."""
    cfg = compose([f"input.path={tmp_path / 'in.jsonl'}", "model.path=/x"])
    with pytest.raises(ConfigError) as refused:
        apply_overrides(cfg, ["+cluster.env.HF_TOKEN=[hf_ab6,2]"])
    assert str(refused.value) == f"cluster.env.HF_TOKEN: Cannot convert 'list' to string: '{REDACTED}'"
    with pytest.raises(ConfigError, match=r"^cluster.time: Value 'abc' .* Integer; cluster.time takes an integer"):
        apply_overrides(cfg, ["cluster.time=abc"])
