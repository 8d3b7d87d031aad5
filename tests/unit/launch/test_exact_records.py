"""Records a command reads back to run (run.yaml, pass.json, a tune's job.json, a trial's spec.json)
hold exactly what runs: only a secret-named key's value is struck there; a free-text value (a prompt
with `key={key}`, a stop string, a --where) is kept as typed, and a secret's value inside one is
refused at compose instead of being rewritten. Each test failed before (attack 42: B1, B17, B12, B4,
B16, B2, B5, B11, B20)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from support.corpus import read_output
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer import security
from batchinfer.config.compose import compose
from batchinfer.config.schema import to_dict
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch.local import run_local, run_task
from batchinfer.launch.slurm import env_lines
from batchinfer.redaction import REDACTED, exact, exact_yaml, has_url_password, redact_text
from batchinfer.rundir import passes
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir
from batchinfer.tune.job import TuneJob, read_record, write_record
from batchinfer.tune.process import TrialProcess
from batchinfer.tune.settings import Setting, parse_tries, try_secrets

TEMPLATE = "Sort by key={key}: {text}"
STOP = ["key=end"]


def key_corpus(path: Path) -> Path:
    """Rows with a column named `key`, which a template names as `key={key}`."""
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": f"hello {i}", "key": f"k{i}"}) + "\n" for i in range(6)))
    return path


def test_a_prompt_with_key_equals_runs_as_typed_in_the_task(tmp_path: Path, tiny_model_path: Path) -> None:
    """B1: a Slurm task (run_task reads DIR/run.yaml) prompts with the template the user typed."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    extra = [f"prompt.template={TEMPLATE}", "sampling.stop=['key=end']", "sharding.num_shards=1"]
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "task", *extra))
    run = prepare(cfg)
    stored = yaml.safe_load(run.run_yaml.read_text())["config"]
    assert stored["prompt"]["template"] == TEMPLATE and stored["sampling"]["stop"] == STOP
    assert RunDir(run.path).config.prompt.template == TEMPLATE
    run_task(str(run.path), 0, engine=StandinEngine(cfg))  # what an array task does, from run.yaml
    merge(RunDir(run.path))
    here = run_local(
        compose(run_overrides(tiny_model_path, corpus, tmp_path / "here", *extra)), engine=StandinEngine(cfg)
    )
    task_rows, local_rows = read_output(run.path), read_output(here.path)
    assert len(task_rows) == 6
    for a, b in zip(task_rows, local_rows, strict=True):  # the same prompt: the same tokens, the same answer
        assert (a["id"], a["prompt_tokens"], a["text"]) == (b["id"], b["prompt_tokens"], b["text"])


def test_a_reopen_compares_the_values_as_typed(tmp_path: Path, tiny_model_path: Path) -> None:
    """B17: two prompts that differ only after `key=` are two configs, not one run directory."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    out = tmp_path / "run"
    prepare(compose(run_overrides(tiny_model_path, corpus, out, "prompt.template=Answer {text} with key=aaaa1111")))
    other = compose(run_overrides(tiny_model_path, corpus, out, "prompt.template=Answer {text} with key=bbbb2222"))
    # the difference is after `key=`, struck in printed lines: said, not shown as two identical texts (K8)
    with pytest.raises(RunDirError, match=r"different config: prompt.template \(differs in a redacted part\)"):
        prepare(other)


def test_a_secrets_value_inside_another_value_is_refused_not_rewritten(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B12: a prompt mentioning a secret variable's value is refused, naming the key and the variable."""
    monkeypatch.setenv("PROJECT_TOKEN", "sharedproj01")
    base = run_overrides(tiny_model_path, key_corpus(tmp_path / "k.jsonl"), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"prompt.system holds the value of PROJECT_TOKEN, a secret") as e:
        compose([*base, "prompt.system=You work for sharedproj01."])
    assert "sharedproj01" not in str(e.value) and "unset PROJECT_TOKEN" in str(e.value)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abcdefgh12345")  # an #SBATCH line is refused the same way
    with pytest.raises(ConfigError, match=r"cluster.sbatch_extra.comment holds the value of OPENAI_API_KEY"):
        compose([*base, "+cluster.sbatch_extra.comment=sk-abcdefgh12345"])
    cfg = compose([*base, "prompt.system=You work for the project.", "+cluster.env.PROJECT_TOKEN=sharedproj01"])
    stored = yaml.safe_load(exact_yaml({"config": to_dict(cfg)}))  # the secret entry itself: struck, not refused
    assert stored["config"]["cluster"]["env"]["PROJECT_TOKEN"] == REDACTED


def tune_job(folder: Path) -> TuneJob:
    overrides = ["prompt.template=Q: {text} key=value", "+cluster.env.HF_TOKEN=hf_tunetoken1234"]
    tries = ["env.HF_TOKEN=hf_tunetoken1234 model.max_num_seqs=4", "model.max_num_seqs=8"]
    request = {
        "cwd": "/",
        "overrides": overrides,
        "config_dir": None,
        "options": {"overrides": overrides, "tries": tries},
    }
    return TuneJob("bi-tune-x", str(folder / "logs"), 0.0, 10, request)


def test_a_tune_jobs_record_holds_the_overrides_as_typed_but_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B4, B5: TUNE/job.json (the job composes from it) keeps the prompt; a secret travels in the
    job's environment, and the record marking its place is owner-only."""
    old = os.umask(0o022)
    try:
        write_record(tmp_path, tune_job(tmp_path))
    finally:
        os.umask(old)
    req = read_record(tmp_path).request
    assert req["overrides"] == ["prompt.template=Q: {text} key=value", f"+cluster.env.HF_TOKEN={REDACTED}"]
    assert req["options"]["tries"] == [f"env.HF_TOKEN={REDACTED} model.max_num_seqs=4", "model.max_num_seqs=8"]
    assert "hf_tunetoken1234" not in (tmp_path / "job.json").read_text()
    assert stat.S_IMODE((tmp_path / "job.json").stat().st_mode) == 0o600
    # the job side: a struck env.NAME takes the job's environment's value (which sbatch handed it)
    monkeypatch.setenv("HF_TOKEN", "hf_tunetoken1234")
    assert parse_tries(req["options"]["tries"])[0].env == {"HF_TOKEN": "hf_tunetoken1234"}
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ConfigError, match=r"env.HF_TOKEN is a secret, and secrets are not stored"):
        parse_tries(req["options"]["tries"])
    # the login side: the secret the tries give is put in the sbatch environment
    assert try_secrets(tune_job(tmp_path).request["options"]["tries"]) == {"HF_TOKEN": "hf_tunetoken1234"}
    with pytest.raises(ConfigError, match=r"--try gives env.HF_TOKEN two values"):
        try_secrets(["env.HF_TOKEN=hf_aaaaaaaaaaaa", "env.HF_TOKEN=hf_bbbbbbbbbbbb"])


def test_a_trials_spec_holds_the_overrides_as_typed_but_secrets(tmp_path: Path) -> None:
    """B4, B5: a trial composes from spec.json: the prompt as typed; the secret struck, owner-only."""
    spec = {"overrides": ["prompt.template=Q: {text} key=value", "++cluster.env.HF_TOKEN=hf_tunetoken1234"]}
    old = os.umask(0o022)
    try:
        TrialProcess(Setting(("model.max_num_seqs=4",)), spec, tmp_path / "t")
    finally:
        os.umask(old)
    path = tmp_path / "t" / "spec.json"
    assert json.loads(path.read_text())["overrides"] == [
        "prompt.template=Q: {text} key=value",
        f"++cluster.env.HF_TOKEN={REDACTED}",
    ]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_pass_record_holds_the_where_as_typed(tmp_path: Path) -> None:
    """B16: pass.json keeps --where exactly; two selections differing after `token=` are two commands."""
    where = 'id == "token=r1xxxxxx" or row == 1'
    secret = "+cluster.env.HF_TOKEN=hf_redotoken1234"
    passes.write_record(tmp_path, 1, where, [secret, "sampling.max_tokens=9"], None)
    rec = passes.read_record(tmp_path)
    assert rec.where == where and rec.overrides == [f"+cluster.env.HF_TOKEN={REDACTED}", "sampling.max_tokens=9"]
    assert "hf_redotoken1234" not in (tmp_path / "pass.json").read_text()
    assert rec.same_command(where, [secret, "sampling.max_tokens=9"], None)
    assert not rec.same_command('id == "token=r2yyyyyy" or row == 1', [secret, "sampling.max_tokens=9"], None)
    assert not rec.same_command(where, [secret, "sampling.max_tokens=8"], None)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:V8hhhhhhhh@redis:6379/0", f"redis://:{REDACTED}@redis:6379/0"),
        ("postgres://bob:p@ssw0rd123@db/x", f"postgres://bob:{REDACTED}@db/x"),
    ],
)
def test_a_url_password_with_an_empty_user_or_an_at_sign_is_struck(url: str, shown: str) -> None:
    """B2: printed lines, the environment entry in run.yaml and the sbatch script's exports."""
    assert has_url_password(url) and redact_text(f"connect {url} now") == f"connect {shown} now"
    assert exact({"cluster": {"env": {"REDIS_URL": url}}}) == {"cluster": {"env": {"REDIS_URL": REDACTED}}}
    assert env_lines({"REDIS_URL": url, "N": "2"}) == ["export N=2"]  # it travels in sbatch's environment


def test_a_url_password_outside_cluster_env_is_refused(tmp_path: Path, tiny_model_path: Path) -> None:
    """run.yaml holds input.path exactly (what runs): a password in it is refused, not stored."""
    base = run_overrides(tiny_model_path, key_corpus(tmp_path / "k.jsonl"), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"prompt.system holds a URL with a password") as e:
        compose([*base, "prompt.system=Use redis://:V8hhhhhhhh@redis:6379/0"])
    assert "V8hhhhhhhh" not in str(e.value)


def test_lora_adapter_names_are_labels_not_secret_names(tmp_path: Path) -> None:
    """B11: an adapter named `auth`, `token_classifier` or `passkey` is a folder, not a secret."""
    adapters = {name: str(tmp_path / name) for name in ("auth", "token_classifier", "passkey")}
    config = {"model": {"lora": {"adapters": adapters}}}
    security.check_config_secrets(config)  # refused before as "looks like a secret"
    assert exact(config) == config  # run.yaml keeps the folders the engine loads


def test_printed_json_stays_json_and_loses_its_secrets(capsys: pytest.CaptureFixture) -> None:
    """B20: `--json` printed through the console's redaction is redacted string by string."""
    import sys

    from batchinfer import logs

    print(
        json.dumps({"note": "answer with key=", "x": 1, "cmd": "login --token abc123"}),
        file=logs.RedactingStream(sys.stdout),
    )
    assert json.loads(capsys.readouterr().out) == {
        "note": "answer with key=",
        "x": 1,
        "cmd": f"login --token {REDACTED}",
    }


def test_a_url_entry_struck_in_run_yaml_is_still_a_secret_at_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """attack42b K3: run.yaml holds `DATABASE_URL: <redacted>` (a URL with a password under a name
    that is no secret's); read back at resume it was no URL any more, so the sbatch script exported
    the literal `<redacted>` over the real value."""
    from batchinfer.errors import ConfigError
    from batchinfer.launch.slurm import env_lines
    from batchinfer.security import secret_env

    stored = {"DATABASE_URL": REDACTED, "N": "1"}
    assert env_lines(stored) == ["export N=1"]
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(ConfigError, match="export DATABASE_URL="):
        secret_env(stored)
    monkeypatch.setenv("DATABASE_URL", "postgres://u:pw123456@h/db")
    assert secret_env(stored) == {"DATABASE_URL": "postgres://u:pw123456@h/db"}


def test_an_env_reference_typed_in_a_prompt_reaches_every_task_as_typed(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attack42b K1: `${oc.env:MYVAR}` typed in prompt.system (taken as typed) was filled in by each
    task from its own environment (or kept as text where unset): two tasks, two prompts."""
    corpus = key_corpus(tmp_path / "k.jsonl")
    typed = "You say ${oc.env:MYVAR} and ${oc.env:HF_TOKEN}"
    extra = [f"prompt.system={typed}", "prompt.template=Q: {text}"]
    monkeypatch.setenv("MYVAR", "hello")
    run = prepare(compose(run_overrides(tiny_model_path, corpus, tmp_path / "r", *extra)))
    seen = []
    for value in ("hello", "goodbye", None):
        if value is None:
            monkeypatch.delenv("MYVAR")
        else:
            monkeypatch.setenv("MYVAR", value)
        monkeypatch.setenv("HF_TOKEN", f"hf_{value}")
        seen.append(RunDir(run.path).config.prompt.system)
    assert seen == [typed] * 3
