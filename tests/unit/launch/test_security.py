"""Shared-cluster safety without a cluster: secret names, redaction, modes, symlinks, path checks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, TESTS
from support.corpus import write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer import security
from batchinfer.cli import main
from batchinfer.config.compose import compose
from batchinfer.config.schema import to_dict
from batchinfer.errors import ConfigError, FolderRefused, InputError
from batchinfer.launch import slurm
from batchinfer.launch.local import run_shards
from batchinfer.launch.submit import submit_shards
from batchinfer.redaction import redact
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import PREPARING, prepare
from batchinfer.rundir.store import RunDir

SECRET = [
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "api_key",
    "apiKey",
    "APIKEY",
    "OPENAI_API_KEY",
    "x-api-key",
    "db_password",
    "DB_PASSWD",
    "AWS_SECRET_ACCESS_KEY",
    "client.secret",
    "credential",
    "auth",
    "GITHUB_AUTH",
    "hfToken",
    "PGPASSWORD",
    "HFTOKEN",
    "MYSQL_PWD_PASSWORD",
    "HFToken",
    "token",
    "KEY",
    "ssh_passphrase",
]
NOT_SECRET = [
    "max_tokens",
    "prompt_tokens",
    "output_tokens",
    "max_num_batched_tokens",
    "skip_special_tokens",
    "keep",
    "keys",
    "sort_keys",
    "fingerprint_keys",
    "tokenizer",
    "tokenizer_mode",
    "author",
    "authors",
    "monkey",
    "keyboard",
    "secretary",
    "MONKEY",
    "NUM_TOKENS",
    "TOKENIZERS_PARALLELISM",
    "passage",
    "PATH",
    "PWD",
    "HF_HOME",
    "VLLM_CPU_KVCACHE_SPACE",
    "id_column",
    "chat_template_kwargs",
    "GOOGLE_APPLICATION_CREDENTIALS",  # a path: the file holds the secret
]
PLANTED = "hf_PLANTEDunit1234567890"


@pytest.fixture(autouse=True)
def _cli_logging() -> None:
    """main() binds batchinfer's log handler to this test's captured stderr: drop it afterwards."""
    import logging

    yield
    logging.getLogger("batchinfer").handlers.clear()


@pytest.mark.parametrize("name", SECRET)
def test_secret_names(name: str) -> None:
    assert security.is_secret_name(name)


@pytest.mark.parametrize("name", NOT_SECRET)
def test_names_that_are_not_secret(name: str) -> None:
    assert not security.is_secret_name(name)


def test_secret_config_values_are_refused_outside_cluster_env() -> None:
    with pytest.raises(ConfigError, match=r"model.engine_kwargs.hf_token looks like a secret.*export HF_TOKEN") as e:
        compose([f"+model.engine_kwargs.hf_token={PLANTED}"])
    assert PLANTED not in str(e.value)
    # Few-shot examples are row data: a column named `key` or `token` is fine.
    cfg = compose(["+prompt.examples=[{token: a, key: b, answer: c}]", f"+cluster.env.HF_TOKEN={PLANTED}"])
    assert cfg.cluster.env.HF_TOKEN == PLANTED


def test_run_yaml_and_sbatch_setup_never_hold_secret_values(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm, "max_array_size", lambda: 1001)  # no cluster needed for a dry run
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    env = [f"+cluster.env.WANDB_API_KEY={PLANTED}", "+cluster.env.PLAIN=a b", "+cluster.env.HF_TOKEN="]
    run = prepare(compose(fake_overrides(tmp_path, corpus, "cluster=slurm", *env)))
    text = run.run_yaml.read_text()
    assert PLANTED not in text and "WANDB_API_KEY: <redacted>" in text and "HF_TOKEN: ''" in text
    assert run.run["config"]["cluster"]["env"]["WANDB_API_KEY"] == PLANTED  # kept in memory for the submission
    params = slurm.array_parameters(run.config.cluster, 1)
    assert params["setup"] == ["export PLAIN='a b'"]
    assert slurm.merge_parameters(run.config.cluster, ["1"])["setup"] == params["setup"]
    submit_shards(run, [0], dry_run=True)  # prints the sbatch parameters
    assert PLANTED not in capsys.readouterr().out
    # Reopened (as `resume` does), the secret comes from the submitting shell's environment.
    stored = RunDir(run.path).run["config"]["cluster"]["env"]
    assert stored["WANDB_API_KEY"] == security.REDACTED
    os.environ.pop("WANDB_API_KEY", None)
    with pytest.raises(ConfigError, match=r"export WANDB_API_KEY=\.\.\."):
        security.secret_env(stored)
    with security.submission_env({"WANDB_API_KEY": PLANTED, "PLAIN": "x"}):
        assert os.environ["WANDB_API_KEY"] == PLANTED and "PLAIN" not in os.environ
    assert "WANDB_API_KEY" not in os.environ


def test_a_users_export_list_gets_the_secret_names() -> None:
    env = {"HF_TOKEN": "x", "PLAIN": "y"}
    assert security.export_option({}, env) == {}
    assert security.export_option({"export": "NONE"}, env) == {"export": "NONE,HF_TOKEN"}
    assert security.export_option({"export": "ALL,HF_TOKEN"}, env) == {"export": "ALL,HF_TOKEN"}


@pytest.mark.parametrize("command", ["submit", "run", "plan", "validate"])
def test_cfg_job_shows_secrets_redacted(capsys: pytest.CaptureFixture, command: str) -> None:
    env = [f"+cluster.env.HF_TOKEN={PLANTED}", f"+cluster.env.PGPASSWORD={PLANTED}", "+cluster.env.PLAIN=p"]
    assert main([command, "--cfg", "job", *env]) == 0
    out = capsys.readouterr().out
    assert PLANTED not in out and "HF_TOKEN: <redacted>" in out and "PGPASSWORD: <redacted>" in out
    assert "PLAIN: p" in out


@pytest.mark.parametrize(
    "override",
    [
        f"cluster.setup=['module load cuda', 'export HF_TOKEN={PLANTED}']",
        f"cluster.setup=['PGPASSWORD={PLANTED} psql -c select']",
        f"+cluster.sbatch_extra.export='ALL,WANDB_API_KEY={PLANTED}'",
    ],
)
def test_a_secret_set_in_setup_lines_or_sbatch_extra_is_refused(override: str) -> None:
    with pytest.raises(
        ConfigError, match=r"cluster\.(setup\[\d\]|sbatch_extra\.export) sets \w+, which looks like a secret"
    ) as e:
        compose([override])
    assert PLANTED not in str(e.value)
    # a reference to the environment is fine: the value is not in the config
    compose(["cluster.setup=['export HF_TOKEN=$HF_TOKEN', 'PGPASSWORD=\"$PGPASSWORD\" psql']"])


def test_output_private_values() -> None:
    assert [security.private_mode(v) for v in (False, "false", True, "true", "user", "group")] == [
        None,
        None,
        "user",
        "user",
        "user",
        "group",
    ]
    with pytest.raises(ConfigError, match=r"output.private='world' is not one of: false, true \(= user\), user, group"):
        compose(["output.private=world"])


def test_log_folder_slurm_cannot_take_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contains a newline"):
        slurm.check_log_folder(tmp_path / "a\nb" / "logs" / "submission-000")
    with pytest.raises(ConfigError, match="contains a %"):
        slurm.check_log_folder(tmp_path / "100%j" / "logs" / "submission-000")
    slurm.check_log_folder(tmp_path / "a b 'q' $(x)" / "logs" / "submission-000")


# ---------------------------------------------------------------- modes

MODES = """
import os, sys
sys.path.insert(0, sys.argv[1])
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.redaction import redact
from batchinfer.config.compose import compose
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import PREPARING, prepare
from pathlib import Path
tmp, corpus, umask, private = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4], 8), sys.argv[5]
os.umask(umask)
run = prepare(compose(fake_overrides(tmp, corpus, f"output.private={private}", "sharding.num_shards=2")))
run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
merge(run)
"""


def modes_under(d: Path) -> dict[str, int]:
    """Permission bits of d and everything in it, by path relative to d."""
    return {str(p.relative_to(d)): stat.S_IMODE(p.lstat().st_mode) for p in [d, *d.rglob("*")]}


@pytest.mark.parametrize(
    ("umask", "private", "dir_mode", "file_mode"),
    [
        (0o027, "false", 0o750, 0o640),
        (0o077, "false", 0o700, 0o600),
        (0o022, "false", 0o755, 0o644),
        (0o000, "true", 0o700, 0o600),
        (0o000, "group", 0o750, 0o640),
        (0o077, "group", 0o750, 0o640),
    ],
)
def test_run_dir_modes_follow_umask_or_output_private(
    tmp_path: Path, umask: int, private: str, dir_mode: int, file_mode: int
) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12)
    tests = str(TESTS)
    res = subprocess.run(
        [sys.executable, "-c", MODES, tests, str(tmp_path), str(corpus), oct(umask), private],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    modes = modes_under(tmp_path / "run")
    for must in ("run.yaml", "plan.json", "input", "shards/00000/rows.jsonl", "stats.json", "output.parquet"):
        assert must in modes or must.replace("jsonl", "parquet") in modes, sorted(modes)
    wrong = {p: oct(m) for p, m in modes.items() if m != (dir_mode if (tmp_path / "run" / p).is_dir() else file_mode)}
    assert not wrong, wrong


def test_private_chmods_a_dir_made_before(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    run = prepare(compose(fake_overrides(tmp_path, corpus)))
    os.chmod(run.path, 0o755)
    prepare(compose(fake_overrides(tmp_path, corpus, "output.private=true")))
    modes = modes_under(run.path)
    assert {oct(m) for m in modes.values()} == {"0o700", "0o600"}, modes


# ---------------------------------------------------------------- status warning


@pytest.fixture
def open_tmp() -> Path:
    """A folder every user can pass through (pytest's own tmp folders are 0700)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="bi-open-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def test_status_warns_when_dir_is_world_readable_and_input_is_not(
    open_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus = open_tmp / "c.jsonl"
    write_corpus(corpus, 4)
    run = prepare(compose(fake_overrides(open_tmp, corpus)))
    os.chmod(run.path, 0o755)
    for input_mode, warned in ((0o600, True), (0o640, True), (0o644, False)):
        os.chmod(corpus, input_mode)
        assert main(["status", str(run.path)]) == 0
        err = capsys.readouterr().err
        expected = f"warning: {run.path} is readable by every user but {corpus} is not: set output.private=true or chmod o-rx {run.path}"
        assert (expected in err) == warned, (oct(input_mode), err)
    os.chmod(corpus, 0o600)
    prepare(compose(fake_overrides(open_tmp, corpus, "output.private=true")))
    assert main(["status", str(run.path), "--json"]) == 0
    assert "warning" not in capsys.readouterr().err


# ---------------------------------------------------------------- symlinks and paths


def sentinel(tmp_path: Path) -> Path:
    """A folder outside DIR whose file must survive."""
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    (d / "precious.txt").write_text("keep me")
    return d


def test_symlinked_input_and_temporaries_are_unlinked_never_followed(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 6)
    outside = sentinel(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("input", "input.tmp", ".hf-cache"):
        (run_dir / name).symlink_to(outside, target_is_directory=True)
    with pytest.raises(FolderRefused, match="batchinfer did not make it"):  # not its folder: left alone
        prepare(compose(fake_overrides(tmp_path, corpus)))
    (run_dir / PREPARING).touch()  # a folder prepare made and was killed in: its entries are unlinked
    run = prepare(compose(fake_overrides(tmp_path, corpus)))
    assert (outside / "precious.txt").read_text() == "keep me" and sorted(p.name for p in outside.iterdir()) == [
        "precious.txt"
    ]
    assert not run.input_dir.is_symlink() and run.input_dir.is_dir()
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    for name in (".tmp-output.parquet", ".tmp-old-output.parquet"):
        (run.path / name).symlink_to(outside, target_is_directory=True)
    merge(run)
    assert (outside / "precious.txt").read_text() == "keep me"
    assert not (run.path / ".tmp-output.parquet").exists() and run.output_path.is_file()
    shard_tmp = run.shard_dir(0) / ".tmp-part-000009.parquet"
    shard_tmp.symlink_to(outside / "precious.txt")
    run.shard_folder(0).remove_temporaries_and_leftovers()
    assert (outside / "precious.txt").is_file()


def test_split_output_over_a_symlinked_temporary_folder(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 6)
    outside = sentinel(tmp_path)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.max_rows_per_file=4")))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    (run.path / ".tmp-output").symlink_to(outside, target_is_directory=True)
    merge(run)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert len(list(run.output_path.iterdir())) == 2


def test_config_dir_and_input_path_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"--config-dir nope: no such directory \(resolved to /"):
        compose([], config_dir="nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"--config-dir .*/f: not a directory"):
        compose([], config_dir=str(tmp_path / "f"))
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 2)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) in (tmp_path, corpus) else real(p, mode))
    with pytest.raises(ConfigError, match=r"--config-dir .*: not readable \(permission denied\)"):
        compose([], config_dir=str(tmp_path))
    with pytest.raises(InputError, match=r"input.path .*c.jsonl: not readable \(permission denied"):
        prepare(compose(fake_overrides(tmp_path, corpus)))


def test_resolved_config_keeps_plain_env_values() -> None:
    c = to_dict(compose(["+cluster.env.A=1", "+cluster.env.API_KEY=s"]))
    assert redact(c)["cluster"]["env"] == {"A": "1", "API_KEY": "<redacted>"}
    assert c["cluster"]["env"]["API_KEY"] == "s"


def test_a_local_run_gives_its_engine_cluster_env_as_a_slurm_task_gets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`batchinfer run` applies cluster.env while its own engine runs (a tuned thread binding works
    locally too), secrets included; the process's environment is restored after."""
    from batchinfer.launch import local

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    monkeypatch.setenv("BATCHINFER_TEST_KEPT", "before")
    monkeypatch.delenv("BATCHINFER_TEST_BIND", raising=False)
    seen: dict[str, object] = {}

    def fake_run_shards(run: RunDir, todo: list[int], engine: object) -> None:
        names = ("BATCHINFER_TEST_BIND", "WANDB_API_KEY", "BATCHINFER_TEST_KEPT")
        seen.update({k: os.environ.get(k) for k in names})
        raise RuntimeError("stop before merge")

    monkeypatch.setattr(local, "run_shards", fake_run_shards)
    env = ["++cluster.env.BATCHINFER_TEST_BIND=0-1", f"+cluster.env.WANDB_API_KEY={PLANTED}"]
    env.append("+cluster.env.BATCHINFER_TEST_KEPT=during")
    with pytest.raises(RuntimeError, match="stop before merge"):
        local.run_local(compose(fake_overrides(tmp_path, corpus, *env)))
    assert seen == {"BATCHINFER_TEST_BIND": "0-1", "WANDB_API_KEY": PLANTED, "BATCHINFER_TEST_KEPT": "during"}
    assert "BATCHINFER_TEST_BIND" not in os.environ and os.environ["BATCHINFER_TEST_KEPT"] == "before"
    assert os.environ.get("WANDB_API_KEY") != PLANTED
