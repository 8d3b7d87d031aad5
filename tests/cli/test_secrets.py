"""Secrets planted by name and by value through every command run here (run, status, report,
resume, redo, tune, cancel, --cfg job): none is in any file of DIR or the tune folder, nor in
anything printed; the run still gets them where they are used (the stand-in engine: the records
are what this proves; tests/slurm/test_slurm_secrets.py submits)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml
from support.corpus import read_output, write_corpus
from support.procs import run_cli
from support.runs import run_overrides
from support.standin import standin_env

pytestmark = [pytest.mark.engine]

# The names, each given on the command line (cluster.env) and set in the environment.
BY_NAME = {
    "GITHUB_PAT": "ghp_PLANTEDpat0123456789",
    "CI_JOB_JWT": "eyJPLANTEDjwt.0123456789",
    "SLACK_WEBHOOK": "https://hooks.slack.com/services/PLANTEDwebhook",
    "DB_PASS": "dbPLANTED12",
    "MYSQL_PWD": "myPLANTED34",
    "SESSION_COOKIE": "sessPLANTEDcookie0987",
}
DB_PASSWORD = "pgPLANTEDurlpw"  # in DATABASE_URL, whose name is no secret's
HF = "hf_PLANTEDenv0123456789"  # only in the environment, used through ${oc.env:HF_TOKEN}
BY_VALUE = "PLANTEDvalue-0123456789"  # MY_SERVICE_TOKEN's value: refused in keys that are no secret's
# A GitHub token's shape under a name that is no secret's (CI_HELPER): a secret by its value.
BY_SHAPE = "ghp_PLANTEDshape0123456789abcdefghijklmn"
PLANTED = [*BY_NAME.values(), DB_PASSWORD, HF, BY_VALUE, BY_SHAPE]


def planted_env() -> dict[str, str]:
    """The submitting shell: the secrets set (the stand-in engine named)."""
    return standin_env(dict(os.environ, **BY_NAME, HF_TOKEN=HF, MY_SERVICE_TOKEN=BY_VALUE, CI_HELPER=BY_SHAPE))


def secret_overrides() -> list[str]:
    """Secrets by name in cluster.env, a URL's password, ${oc.env:HF_TOKEN} in a few-shot
    example, a reference in cluster.setup (a secret's value in other keys: refused, by_value), a
    secret by its shape under a neutral name, a setting whose name holds a secret word."""
    return [
        *(f"+cluster.env.{k}={v}" for k, v in BY_NAME.items()),
        f"+cluster.env.DATABASE_URL=postgres://app:{DB_PASSWORD}@db.example/app",
        f"+cluster.env.CI_HELPER={BY_SHAPE}",
        "+cluster.env.TOKEN_LIMIT=4096",
        "cluster.setup=['echo ok >/dev/null', 'login --token \"$HF_TOKEN\"']",
        "prompt.examples=[{text: '${oc.env:HF_TOKEN}', answer: ok}]",
        "cluster.env_inherit=[HF_TOKEN]",
    ]


def leaks(folders: list[Path], printed: dict[str, str]) -> list[str]:
    """Each file under the folders, and each command's output, holding a planted secret."""
    files = [p for d in folders for p in d.rglob("*") if p.is_file() and not p.is_symlink()]
    hits = [f"{p}: {s}" for p in files for s in PLANTED if s.encode() in p.read_bytes()]
    hits += [f"`{cmd}`: {s}" for cmd, text in printed.items() for s in PLANTED if s in text]
    assert len(files) > 20, files
    return hits


@pytest.mark.timeout(900)
def test_no_command_writes_or_prints_a_secret(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12, seed=5)
    corpus.chmod(0o600)  # the corpus is private: what is made from it stays so
    out, tune = tmp_path / "run", tmp_path / "tune"
    env = planted_env()
    printed: dict[str, str] = {}

    def cli(*args: str, code: int = 0, shell: dict[str, str] = env) -> str:
        res = run_cli(list(args), env=shell, preexec_fn=lambda: os.umask(0o022))
        assert res.returncode == code, res.stderr[-3000:]
        printed[f"{len(printed)}: {args[0]}"] = res.stdout + res.stderr
        return res.stdout + res.stderr

    ov = run_overrides(tiny_model_path, corpus, out, *secret_overrides())
    # a secret's value in keys that are no secret's is refused, naming the key and the variable
    for by_value in (f"+cluster.env.PLAIN_SETTING={BY_VALUE}", f"cluster.setup=['echo \"{BY_VALUE}\"']"):
        said = cli("validate", *ov, by_value, code=2)
        assert "holds the value of MY_SERVICE_TOKEN, a secret" in said, said
    said = cli("validate", *ov, f"prompt.system=Call it with {BY_SHAPE}", code=2)
    assert "prompt.system holds what looks like a GitHub token" in said, said
    cli("submit", "--cfg", "job", *ov)
    said = cli("run", *ov)
    assert "user-private as its input is" in said, said
    # The task resolved the example's ${oc.env:HF_TOKEN}: the same answers as the value written out
    # (in a shell where HF_TOKEN is no secret variable: else that value is refused there).
    literal = [o for o in ov if not o.startswith(("prompt.examples=", "cluster.env_inherit="))]
    literal += [f"prompt.examples=[{{text: {HF}, answer: ok}}]", f"output.dir={tmp_path / 'literal'}"]
    cli("run", *literal, shell={k: v for k, v in env.items() if k != "HF_TOKEN"})
    assert read_output(out) == read_output(tmp_path / "literal") and len(read_output(out)) == 12
    stored = yaml.safe_load((out / "run.yaml").read_text())["config"]
    # secrets by name are struck; a secret's value is a reference to its variable, which a task resolves
    assert {k: stored["cluster"]["env"][k] for k in BY_NAME} == dict.fromkeys(BY_NAME, "<redacted>")
    assert stored["cluster"]["env"]["DATABASE_URL"] == "<redacted>"
    # a shaped value under a neutral name is a secret; a setting named with a secret word is kept
    assert stored["cluster"]["env"]["CI_HELPER"] == "<redacted>" and stored["cluster"]["env"]["TOKEN_LIMIT"] == "4096"
    assert stored["cluster"]["setup"][1] == 'login --token "$HF_TOKEN"'
    assert stored["prompt"]["examples"] == [{"text": "${oc.env:HF_TOKEN}", "answer": "ok"}]
    # the input's own restriction is kept on DIR/input (umask 022 would make it 0644)
    made = [p for p in (out / "input").rglob("*") if p.is_file()]
    assert made and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in made)
    cli("status", str(out))
    cli("status", str(out), "--json")
    cli("report", str(out))
    cli("report", str(out), "--json")
    cli("resume", str(out), "cluster.env.SESSION_COOKIE=" + BY_NAME["SESSION_COOKIE"])
    cli("redo", str(out), "--where", "row < 4", f"cluster.env.GITHUB_PAT={BY_NAME['GITHUB_PAT']}", "sampling.seed=7")
    status = cli("status", str(out))
    # pass.json holds the redo's overrides as typed, a secret-named key's value struck
    assert "cluster.env.GITHUB_PAT=<redacted> sampling.seed=7" in status
    cli("status", str(out), "--json")
    cli("cancel", str(out))
    cli("tune", *ov, "--rows", "8", "--try", "defaults", "--out", str(tune), "--json")
    cli("status", str(tune))
    assert list(tune.glob("trials/*/*/spec.json"))
    hits = leaks([out, tune], printed)  # `literal` holds HF's value as typed: no secret in that shell
    print(f"planted secrets searched in the files of {out} and {tune} and {len(printed)} outputs: {len(hits)} hits")
    assert not hits, hits


def test_errors_print_no_secret_and_a_record_holding_ones_place_is_owner_only(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """The console end to end (the redacting stream of the real CLI): a URL's password in the
    input.path error after the path's normalisation, a secret echoed by a type error, a cluster.env
    key without `+`, a bearer token in cluster.setup; then run.yaml made 0600 under umask 022."""
    secret = "hf_PLANTEDcli0123456789"
    corpus, out = tmp_path / "c.jsonl", tmp_path / "run"
    write_corpus(corpus, 4, seed=3)
    ov = run_overrides(tiny_model_path, corpus, out)
    env = standin_env()

    def cli(*args: str) -> tuple[int, str]:
        res = run_cli(list(args), env=env, preexec_fn=lambda: os.umask(0o022))
        return res.returncode, res.stdout + res.stderr

    bearer = f"cluster.setup=['curl -H \"Authorization: Bearer {secret}\" https://x/y']"
    said = {
        "path": cli("validate", *ov, f"input.path=https://bob:{secret}@host/x.jsonl"),
        "type": cli("validate", *ov, f"+cluster.env.HF_TOKEN={secret}", f"cluster.time={secret}"),
        "no plus": cli("validate", *ov, f"cluster.env.HF_TOKEN={secret}"),
        "setup": cli("validate", *ov, bearer),
    }
    assert {k: code for k, (code, _) in said.items()} == dict.fromkeys(said, 2)
    assert [k for k, (_, text) in said.items() if secret in text] == []
    # run.yaml would hold the URL exactly (what runs): a password in it is refused at compose
    assert "input.path holds a URL with a password" in said["path"][1]
    assert "cluster.time: Value '${oc.env:HF_TOKEN}' of type 'str'" in said["type"][1]
    assert "cluster.env has no key HF_TOKEN yet: write +cluster.env.HF_TOKEN=..." in said["no plus"][1]
    assert "cluster.setup[0] gives a secret" in said["setup"][1]
    code, text = cli("run", *ov, f"+cluster.env.HF_TOKEN={secret}")
    assert code == 0, text
    run_yaml = out / "run.yaml"
    assert "HF_TOKEN: <redacted>" in run_yaml.read_text() and secret not in run_yaml.read_text()
    assert stat.S_IMODE(run_yaml.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "output.parquet").stat().st_mode) == 0o644  # no secret's place: the umask's
