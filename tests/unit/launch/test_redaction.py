"""The one redaction (batchinfer/redaction.py): names as secret scanners match them, URL passwords,
values of this environment's secrets, options in shell lines; records and printed lines."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from batchinfer import redaction, security
from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError
from batchinfer.launch import slurm
from batchinfer.redaction import REDACTED, is_secret_name, record_json, redact, redact_text

# The names and the word parts secret scanners match.
SECRET = ["GITHUB_PAT", "CI_JOB_JWT", "SLACK_WEBHOOK", "DB_PASS", "MYSQL_PWD", "SESSION_COOKIE", "x-auth-token"]
NOT_SECRET = ["DATABASE_URL", "passes", "bypass", "PWD", "OLDPWD", "path", "cookbook", "env_inherit"]
VALUE = "s3cr3tVALUE-0123456789"


@pytest.mark.parametrize("name", SECRET)
def test_names_secret_scanners_match(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", NOT_SECRET)
def test_names_that_hold_no_secret(name: str) -> None:
    assert not is_secret_name(name)


def test_text_loses_url_passwords_assignments_and_secret_options() -> None:
    line = "psql postgres://app:hunter22@db/app && login --token abc123 --api-key=k1 DB_PASS=pw1 N=2"
    assert redact_text(line) == (
        f"psql postgres://app:{REDACTED}@db/app && login --token {REDACTED} --api-key={REDACTED} DB_PASS={REDACTED} N=2"
    )
    # references to a variable are no secret: they stay
    kept = 'login --token "$HF_TOKEN" PGPASSWORD=$PGPASSWORD +cluster.env.HF_TOKEN=${oc.env:HF_TOKEN}'
    assert redact_text(kept) == kept
    assert redact_text("+cluster.env.HF_TOKEN=hf_x sampling.max_tokens=64") == (
        f"+cluster.env.HF_TOKEN={REDACTED} sampling.max_tokens=64"
    )


def test_a_value_of_a_secret_variable_becomes_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", VALUE)
    monkeypatch.setenv("SHORT_TOKEN", "abc1234")  # under MIN_VALUE_LENGTH: "abc1234" is left everywhere
    monkeypatch.setenv("GOOGLE_CREDENTIALS_FILE", "/home/u/creds.json")  # a location, not a secret
    monkeypatch.setenv("PLAIN", VALUE + "x")  # no secret's name: its value is no secret
    assert redact_text(f"a {VALUE} b abc1234 /home/u/creds.json") == (
        "a ${oc.env:MY_SERVICE_TOKEN} b abc1234 /home/u/creds.json"
    )
    assert len("abc1234") < redaction.MIN_VALUE_LENGTH <= len(VALUE)


def test_records_lose_values_under_secret_names_but_keep_row_data_and_references() -> None:
    record = {
        "config": {
            "cluster": {"env": {"HF_TOKEN": "hf_x", "DATABASE_URL": "postgres://a:b@h/d", "N": "1"}},
            "prompt": {"examples": [{"token": "a column", "answer": "b"}]},
        },
        "overrides": ["+cluster.env.SESSION_COOKIE=c1"],
        "output_schema": {"columns": {"key": "string"}},
        "env": {"GITHUB_PAT": "${oc.env:GITHUB_PAT}", "count_tokens": 3},
    }
    assert redact(record) == {
        "config": {
            "cluster": {"env": {"HF_TOKEN": REDACTED, "DATABASE_URL": REDACTED, "N": "1"}},
            "prompt": {"examples": [{"token": "a column", "answer": "b"}]},
        },
        "overrides": [f"+cluster.env.SESSION_COOKIE={REDACTED}"],
        "output_schema": {"columns": {"key": "string"}},
        "env": {"GITHUB_PAT": "${oc.env:GITHUB_PAT}", "count_tokens": 3},
    }
    assert "c1" not in record_json(record) and "hf_x" not in record_json(record)


def test_printed_lines_and_log_lines_are_redacted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sys

    monkeypatch.setenv("MY_SERVICE_TOKEN", VALUE)
    stream = redaction.RedactingStream(sys.stdout)
    print(f"submitting --token {VALUE} x", file=stream)
    record = logging.LogRecord("batchinfer", logging.INFO, "f", 1, "ran %s", (f"DB_PASS=pw {VALUE}",), None)
    redaction.RedactingFilter().filter(record)
    assert capsys.readouterr().out == "submitting --token ${oc.env:MY_SERVICE_TOKEN} x\n"
    assert record.getMessage() == f"ran DB_PASS={REDACTED} ${{oc.env:MY_SERVICE_TOKEN}}"


def test_secret_interpolations_wait_for_the_task(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinfer.config.schema import to_dict

    monkeypatch.setenv("HF_TOKEN", VALUE)
    c = to_dict(compose(["prompt.examples=[{text: '${oc.env:HF_TOKEN}', answer: a}]", "cluster=slurm"]))
    assert c["prompt"]["examples"][0]["text"] == "${oc.env:HF_TOKEN}"
    with pytest.raises(ConfigError, match=r"cluster.partition takes \$\{oc.env:HF_TOKEN\}, a secret"):
        security.check_config_secrets(dict(c, cluster=dict(c["cluster"], partition="${oc.env:HF_TOKEN}")))
    # cluster.env values refer to a secret: the script's shell reads it in the task
    env = {"PLAIN": "${oc.env:HF_TOKEN}", "MIXED": 'a "${oc.env:HF_TOKEN}" $b', "HF_TOKEN": REDACTED}
    assert slurm.env_lines(env) == ['export PLAIN="${HF_TOKEN}"', 'export MIXED="a \\"${HF_TOKEN}\\" \\$b"']


def test_a_secret_argument_in_setup_is_refused_and_a_reference_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"cluster.setup\[0\] gives a secret") as e:
        compose(["cluster.setup=['huggingface-cli login --token hf_PLANTEDarg1234']"])
    assert "hf_PLANTEDarg1234" not in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTEDarg1234")  # this shell's secret: the line refers to it instead
    compose(["cluster.setup=['huggingface-cli login --token \"hf_PLANTEDarg1234\"']"])
    compose(["cluster.setup=['huggingface-cli login --token \"$HF_TOKEN\"']"])


def test_env_inherit_is_passed_by_name_and_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"cluster.env_inherit names HF_TOKEN, which is not set in this shell"):
        security.secret_env({}, ["HF_TOKEN"])
    monkeypatch.setenv("HF_TOKEN", VALUE)
    assert security.secret_env({}, ["HF_TOKEN"]) == {}  # --export=ALL hands it on as it is
    assert security.export_option({"export": "NONE"}, {}, ["HF_TOKEN"]) == {"export": "NONE,HF_TOKEN"}


def test_what_is_made_from_a_private_input_stays_private(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    src.chmod(0o640)
    made = tmp_path / "input"
    made.mkdir(mode=0o755)
    (made / "data.arrow").write_text("x")
    (made / "data.arrow").chmod(0o644)
    assert security.keep_restriction(made, [src]) == f"{made} is made private to your group as its input is"
    assert stat.S_IMODE(made.stat().st_mode) == 0o750
    assert stat.S_IMODE((made / "data.arrow").stat().st_mode) == 0o640
    src.chmod(0o644)
    assert security.keep_restriction(made, [src]) is None
    assert os.access(made, os.R_OK)
