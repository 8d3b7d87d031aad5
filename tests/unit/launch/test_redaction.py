"""The one redaction (batchinfer/redaction.py): names as secret scanners match them, URL passwords,
values of this environment's secrets, options in shell lines; records and printed lines."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from batchinfer import logs, redaction, security
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
    stream = logs.RedactingStream(sys.stdout)
    print(f"submitting --token {VALUE} x", file=stream)
    record = logging.LogRecord("batchinfer", logging.INFO, "f", 1, "ran %s", (f"DB_PASS=pw {VALUE}",), None)
    logs.RedactingFilter().filter(record)
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
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTEDarg1234")  # this shell's secret: refused by value, naming it
    with pytest.raises(ConfigError, match=r"cluster.setup\[0\] holds the value of HF_TOKEN, a secret") as e:
        compose(["cluster.setup=['huggingface-cli login --token \"hf_PLANTEDarg1234\"']"])
    assert "hf_PLANTEDarg1234" not in str(e.value)
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


# Secrets in the syntax of the commands that take them, as cluster.setup lines write them: each
# struck, the rest of the line kept (issue 42's attack on cluster.setup).
P = "PLANTEDsetup-0123456789"
COMMAND_FORMS = [
    (
        f"curl -H 'Authorization: Bearer {P}' https://api.x/v1",
        "curl -H 'Authorization: Bearer <redacted>' https://api.x/v1",
    ),
    (f'curl --header="X-Api-Key: {P}" https://api.x', 'curl --header="X-Api-Key: <redacted>" https://api.x'),
    (f"mysql -u root -p{P} db < q.sql", "mysql -u root -p<redacted> db < q.sql"),
    (f"mysqldump --password={P} db", "mysqldump --password=<redacted> db"),
    (f"curl -u alice:{P} https://x/f -o f", "curl -u alice:<redacted> https://x/f -o f"),
    (f"git clone https://{P}@github.com/o/r.git", "git clone https://<redacted>@github.com/o/r.git"),
    (f"git clone https://bob:{P}@host/r.git", "git clone https://bob:<redacted>@host/r.git"),
    (f"sshpass -p {P} scp a host:b", "sshpass -p <redacted> scp a host:b"),
    (f"aws configure set aws_secret_access_key {P}", "aws configure set aws_secret_access_key <redacted>"),
    (f"export HF_TOKEN={P}", "export HF_TOKEN=<redacted>"),
    (
        f'git config --global http.extraheader "AUTHORIZATION: basic {P}"',
        'git config --global http.extraheader "AUTHORIZATION: basic <redacted>"',
    ),
]
# Lines of the same commands holding no secret: kept as they are.
COMMAND_KEPT = [
    "curl -H 'Accept: application/json' -u alice:$PW https://x",
    "mkdir -p /scratch/x && mysql -p db",
    "git clone git@github.com:o/r.git && git config user.name alice",
    "docker run -u 1000:1000 img",
    'curl -H "Authorization: Bearer $HF_TOKEN" https://x',
    "Answer from the config key given below.",  # a prompt's words, not a tool's command
]


@pytest.mark.parametrize("line,shown", COMMAND_FORMS)
def test_a_secret_in_a_commands_own_syntax_is_struck(line: str, shown: str) -> None:
    assert redact_text(line) == shown
    assert P not in record_json({"cluster": {"setup": [line]}})


@pytest.mark.parametrize("line", COMMAND_KEPT)
def test_the_same_commands_without_a_secret_are_kept(line: str) -> None:
    assert redact_text(line) == line


def test_a_setup_line_with_a_secret_is_refused_and_no_message_or_script_holds_it() -> None:
    from batchinfer.config.schema import ClusterConfig

    for line, _ in COMMAND_FORMS:
        with pytest.raises(
            ConfigError, match=r"cluster.setup\[0\] (gives a secret|sets [A-Za-z_]+, which looks like a secret)"
        ) as e:
            security.check_config_secrets({"cluster": {"setup": [line]}})
        assert P not in redact_text(str(e.value))
    # what the sbatch script would hold of such a line (were it given): struck
    script = "\n".join(slurm.setup_lines(ClusterConfig(setup=[line for line, _ in COMMAND_FORMS])))
    assert P not in script and script.count(REDACTED) == len(COMMAND_FORMS)


# Names as secret scanners match them, words written without separators included; and names that
# only look alike (a location, a word that ends like one), which must stay readable.
SECRET_JOINED = [
    "SECRETKEY",
    "AWSSECRETKEY",
    "SSH_PRIVKEY",
    "csrftoken",
    "hftoken",
    "BEARER",
    "SESSIONID",
    "DBPASS",
    "MYSQLPWD",
    "GITHUBPAT",
    "PASSKEY",
    "SENTRY_DSN",
    "SESSION_ID",
    "OAUTH",
]
NOT_SECRET_ALIKE = [
    "MY_KEY_FILE",
    "KEYBOARD_LAYOUT",
    "MONKEY",
    "TOKENIZERS_PARALLELISM",
    "HF_HUB_OFFLINE",
    "PASSES",
    "max_tokens",
    "compat",
    "secretary",
    "HF_TOKEN_PATH",
    "bypass",
]


def test_names_inside_words_are_secrets_and_look_alikes_are_not() -> None:
    assert [n for n in SECRET_JOINED if not is_secret_name(n)] == []
    assert [n for n in NOT_SECRET_ALIKE if is_secret_name(n)] == []
    env = {n: f"v-{n}" for n in SECRET_JOINED + NOT_SECRET_ALIKE}
    assert redact({"cluster": {"env": env}}) == {
        "cluster": {"env": {n: REDACTED if n in SECRET_JOINED else f"v-{n}" for n in env}}
    }


# Settings users pass in cluster.env that hold a secret word, not a secret (K12): refused or struck,
# they broke runs. A secret word is a secret's name only as the name's last word (after qualifiers).
SETTINGS_NOT_SECRETS = [
    "TOKEN_LIMIT",
    "PRIMARY_KEY",
    "AUTH_ENABLED",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN",
    "PASS_THROUGH",
    "MAX_TOKENS",
    "MAX_TOKEN",
    "KEY_COLUMN",
    "TOKENIZERS_PARALLELISM",
    "AWS_ACCESS_KEY_ID",
    "SECRET_NAME",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SORT_KEY",
    "FORWARD_PASS",
    "PASSWORD_MIN_LENGTH",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "CREDENTIALS_DIRECTORY",
    # a setting word directly before the secret words (USE_AUTH_TOKEN, as HF_HUB_DISABLE_IMPLICIT_TOKEN)
    "USE_AUTH_TOKEN",
    "MY_KEY_FILE",
    "HF_TOKEN_PATH",
    "SSH_KEY_DIR",
    # a key made public, a header's name
    "PUBLIC_KEY",
    "SSH_PUBLIC_KEY",
    "PUBLISHABLE_KEY",
    "STRIPE_PUBLISHABLE_KEY",
    "PUBLIC_API_KEY",
    "PUBLIC_KEY_PEM",
    "API_KEY_HEADER",
]
SECRETS_STILL = [
    "HF_TOKEN",
    "GITHUB_PAT",
    "DB_PASS",
    "MYSQL_PWD",
    "SESSION_COOKIE",
    "CI_JOB_JWT",
    "SLACK_WEBHOOK",
    "SLACK_WEBHOOK_URL",
    "AWS_SECRET_ACCESS_KEY",
    "OPENAI_API_KEY",
    "API_KEY",
    "PRIVATE_KEY",
    "CLIENT_SECRET",
    "API_KEY_VALUE",
    "SECRET_KEY_BASE",
    "HF_TOKEN_2",
    "DB_PASSWORD_PROD",
    "BOT_TOKEN",
    # role and version words after the secret word (the attack on the last-word rule: all were
    # secrets before it, and were written in plain text in run.yaml under it)
    "HF_TOKEN_READ",
    "HF_TOKEN_WRITE",
    "HF_TOKEN_OLD",
    "HF_TOKEN_NEW",
    "HF_TOKEN_ALT",
    "HF_TOKEN_RO",
    "HF_TOKEN_RW",
    "HF_TOKEN_B64",
    "API_KEY_BACKUP",
    "API_KEY_V2",
    "API_KEY_NEW",
    "API_TOKEN_OLD",
    "TOKEN_V2",
    "TOKEN_CI",
    "GITHUB_TOKEN_CI",
    "GH_TOKEN_BOT",
    "OPENAI_API_KEY_ORG1",
    "HFTokenRead",
    "PRIVATE_KEY_PEM",
    "PRIVATE_KEY_DATA",
    "RSA_PRIVATE_KEY_CONTENT",
    "SSH_KEY_ED25519",
    "PGP_KEY_V2",
    "ENCRYPTION_KEY_B64",
    "MY_PASSWORD_HASH",
    "PASSWORD1",
    # a setting word not directly before the secret word
    "RATE_LIMIT_BYPASS_TOKEN",
    "NO_REPLY_EMAIL_PASSWORD",
    "NO_REPLY_SMTP_PASS",
    "MAX_API_KEY",
    "USE_CASE_API_KEY",
    "ALLOW_LIST_TOKEN",
    "SIZE_SERVICE_TOKEN",
    # a connection string holds a key; a path's content is the secret
    "AZURE_STORAGE_CONNECTION_STRING",
    "DB_CONN_STR",
    "KEY_FILE_B64",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
    # two content words after it (the first version of this rule looped for ever on them)
    "HF_TOKEN_B64_VALUE",
    "PRIVATE_KEY_PEM_DATA",
]


@pytest.mark.parametrize("name", SECRETS_STILL)
def test_a_secret_word_last_after_qualifier_role_and_version_words_names_a_secret(name: str) -> None:
    assert is_secret_name(name)
    assert redact({"cluster": {"env": {name: "v-0123456789"}}}) == {"cluster": {"env": {name: REDACTED}}}


@pytest.mark.parametrize("name", SETTINGS_NOT_SECRETS)
def test_a_setting_public_key_or_location_is_no_secret(name: str) -> None:
    assert not is_secret_name(name)


def test_a_secret_word_names_a_secret_only_as_the_last_word() -> None:
    assert [n for n in SETTINGS_NOT_SECRETS if is_secret_name(n)] == []
    assert [n for n in SECRETS_STILL if not is_secret_name(n)] == []
    env = {n: "v-0123456789" for n in SETTINGS_NOT_SECRETS}
    env["DATABASE_URL"] = f"postgres://bob:{P}@db/x"
    # a setting stays in the records read back and is no secret entry (exported as written)
    assert redaction.exact({"cluster": {"env": env}})["cluster"]["env"] == dict(env, DATABASE_URL=REDACTED)
    assert [n for n, v in env.items() if redaction.is_secret_entry(n, v)] == ["DATABASE_URL"]
    security.check_config_secrets({"cluster": {"setup": [f"export {n}=v-0123456789" for n in env if n[0] != "D"]}})
    security.check_config_secrets({"model": {"engine_kwargs": {"max_token": 5, "primary_key": "id"}}})


def test_a_url_password_is_struck_after_a_paths_normalisation(tmp_path: Path) -> None:
    from batchinfer.errors import InputError
    from batchinfer.inputs.paths import input_files

    with pytest.raises(InputError) as e:
        input_files(f"https://bob:{P}@host/x.jsonl")
    assert "https:/bob:" in str(e.value)  # abspath made one slash of two
    assert P not in redact_text(str(e.value)) and redact_text(str(e.value)).count(f"bob:{REDACTED}@host") == 2


def test_a_type_error_echoes_no_secret_by_name_or_by_value() -> None:
    with pytest.raises(ConfigError) as e:
        compose(["+cluster.env.HF_TOKEN=[1,2]"])
    assert str(e.value) == f"cluster.env.HF_TOKEN: Cannot convert 'list' to string: '{REDACTED}'"
    typed = "hf_PLANTEDtyped0123456789"
    with pytest.raises(ConfigError) as e:
        compose([f"+cluster.env.HF_TOKEN={typed}", f"cluster.time={typed}"])
    assert redact_text(str(e.value)).startswith("cluster.time: Value '${oc.env:HF_TOKEN}' of type 'str'")


def test_a_cluster_env_key_without_plus_says_how_to_add_it_and_not_its_value() -> None:
    with pytest.raises(ConfigError) as e:
        compose([f"cluster.env.HF_TOKEN={P}"])
    assert str(e.value) == (
        "cluster.env has no key HF_TOKEN yet: write +cluster.env.HF_TOKEN=... to add it (or, for a secret, "
        "pass it by name: `export HF_TOKEN` in this shell and cluster.env_inherit=[HF_TOKEN], so its value "
        "is on no command line)"
    )


def test_refusals_naming_a_secret_key_are_printed_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    refusals = []
    for bad in (
        lambda: security.check_config_secrets({"cluster": {"setup": ["export HF_TOKEN=abc"]}}),
        lambda: security.check_config_secrets({"model": {"api_key": "abc"}}),
        lambda: security.secret_env({}, ["HF_TOKEN"]),
        lambda: security.secret_env({"HF_TOKEN": REDACTED}),
    ):
        with pytest.raises(ConfigError) as e:
            bad()
        refusals.append(str(e.value))
    assert "`export HF_TOKEN=...` before running batchinfer" in refusals[0]
    assert [redact_text(m) for m in refusals] == refusals
    assert redact_text("login(token=token, key=key)") == "login(token=token, key=key)"


def test_records_marking_a_secrets_place_are_owner_only(tmp_path: Path) -> None:
    from batchinfer.durable import write_json
    from batchinfer.launch.executor import write_script

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "secret.json", {"cluster": {"env": {"HF_TOKEN": "x"}}})
        write_json(tmp_path / "ref.json", {"prompt": {"system": "${oc.env:HF_TOKEN}"}})
        write_json(tmp_path / "plain.json", {"cluster": {"env": {"MY_KEY_FILE": "/k"}}})
        write_script(tmp_path / "s.sh", 'export PLAIN="${HF_TOKEN}"\n')
        write_script(tmp_path / "p.sh", 'export PLAIN="${HOME}"\n')
        shared = tmp_path / "group"
        shared.mkdir(mode=0o750)
        write_json(shared / "secret.json", {"cluster": {"env": {"HF_TOKEN": "x"}}})
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*.*")}
    assert modes == {
        "secret.json": 0o600,
        "ref.json": 0o600,
        "plain.json": 0o644,
        "s.sh": 0o600,
        "p.sh": 0o644,
        "group/secret.json": 0o640,
    }
    assert (tmp_path / "secret.json").read_text().count(REDACTED) == 1
