"""Secrets planted by name and by value through every command that talks to Slurm (submit and its
dry run, status, report, resume, redo as an array, tune as a job, cancel): none is in any file of
DIR (sbatch scripts, submitit's folder, task logs), the tune folder or Slurm's logs, nor in anything
printed; yet each reaches the task by name, through the environment (the stand-in engine)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from support.corpus import read_output, write_corpus
from support.procs import run_cli
from support.slurm import REPO, cluster_overrides, wait_until_idle
from support.standin import standin_env

pytestmark = [pytest.mark.slurm, pytest.mark.engine]
SLURM_LOGS = Path("/tmp/batchinfer-slurm/cluster/log")
BY_NAME = {
    "GITHUB_PAT": "ghp_PLANTEDpat9876543210",
    "CI_JOB_JWT": "eyJPLANTEDjwt.9876543210",
    "SLACK_WEBHOOK": "https://hooks.slack.com/services/PLANTEDhook",
    "DB_PASS": "dbPLANTED98",
    "MYSQL_PWD": "myPLANTED76",
    "SESSION_COOKIE": "sessPLANTEDcookie1234",
}
DB_PASSWORD = "pgPLANTEDurl98"
DATABASE_URL = f"postgres://app:{DB_PASSWORD}@db.example/app"
HF = "hf_PLANTEDinherit9876543210"  # in the environment only: cluster.env_inherit=[HF_TOKEN]
BY_VALUE = "PLANTEDvalue-9876543210"  # MY_SERVICE_TOKEN's value: refused in keys that are no secret's
PLANTED = [*BY_NAME.values(), DB_PASSWORD, HF, BY_VALUE]
# Each task's setup prints a digest of what reached it: the value, never the value itself.
SETUP = (
    "cluster.setup=["
    "'printf %s \"$HF_TOKEN\" | sha256sum | sed s/^/hf-token-/', "
    "'printf %s \"$MY_SERVICE_TOKEN\" | sha256sum | sed s/^/by-value-/', "
    "'printf %s \"$DATABASE_URL\" | sha256sum | sed s/^/db-url-/']"
)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def overrides(
    tmp: Path, corpus: Path, model: Path, example: str, out: Path, inherit: str = "[HF_TOKEN,MY_SERVICE_TOKEN]"
) -> list[str]:
    return cluster_overrides(
        tmp,
        corpus,
        model,
        "sampling.max_tokens=4",
        SETUP,
        *(f"+cluster.env.{k}={v}" for k, v in BY_NAME.items()),
        f"+cluster.env.DATABASE_URL={DATABASE_URL}",
        f"cluster.env_inherit={inherit}",
        f"prompt.examples=[{{text: {example}, answer: ok}}]",
        out=out,
    )


@pytest.mark.timeout(1500)
def test_secrets_reach_tasks_by_name_and_no_record_or_output_holds_them(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 10, seed=11)
    run_dir, tune, literal = tmp_path / "run", tmp_path / "tune", tmp_path / "literal"
    # the shell a user resumes from exports the secrets run.yaml does not keep (DATABASE_URL too)
    env = standin_env(
        dict(
            os.environ,
            **BY_NAME,
            HF_TOKEN=HF,
            MY_SERVICE_TOKEN=BY_VALUE,
            DATABASE_URL=DATABASE_URL,
            PYTHONPATH=str(REPO),
        )
    )
    printed: dict[str, str] = {}

    def cli(*args: str) -> str:
        res = run_cli(list(args), env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        printed[f"{len(printed)}: {args[0]}"] = res.stdout + res.stderr
        return res.stdout + res.stderr

    ov = overrides(tmp_path, corpus, tiny_model_path, "'${oc.env:HF_TOKEN}'", run_dir)
    # a secret's value in a key that is no secret's is refused (records hold exactly what runs)
    refused = run_cli(["validate", *ov, f"+cluster.env.PLAIN_SETTING={BY_VALUE}"], env=env)
    assert refused.returncode == 2 and "holds the value of MY_SERVICE_TOKEN" in refused.stderr, refused.stderr
    printed["refused"] = refused.stdout + refused.stderr
    cli("submit", *ov, "--dry-run")
    cli("submit", *ov)
    wait_until_idle(run_dir)
    # the task resolved ${oc.env:HF_TOKEN} from its environment: the answers of the value written out
    # (in a shell where HF_TOKEN is no secret variable: else that value is refused there)
    plain = {k: v for k, v in env.items() if k != "HF_TOKEN"}
    said = run_cli(
        ["run", *overrides(tmp_path, corpus, tiny_model_path, HF, literal, "[]"), "cluster=local"], env=plain
    )
    assert said.returncode == 0, said.stderr[-3000:]
    assert read_output(run_dir) == read_output(literal) and len(read_output(run_dir)) == 10
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.*"))
    for prefix, value in (("hf-token", HF), ("by-value", BY_VALUE), ("db-url", DATABASE_URL)):
        assert f"{prefix}-{sha(value)}" in logs, (prefix, logs[-3000:])
    # secrets by name get no export line: the scripts leave them to the task's environment
    scripts = [p.read_text() for p in (run_dir / "logs").rglob("*_submission.sh")]  # the array's, the merge's
    assert len(scripts) == 2 and all("export DB_PASS" not in s and '"$MY_SERVICE_TOKEN"' in s for s in scripts)
    cli("status", str(run_dir))
    cli("status", str(run_dir), "--json")
    cli("report", str(run_dir), "--json")
    cli("resume", str(run_dir), "cluster.time=25", f"cluster.env.DB_PASS={BY_NAME['DB_PASS']}")
    cli("redo", str(run_dir), "--where", "row < 3", "sampling.seed=3", f"cluster.env.MYSQL_PWD={BY_NAME['MYSQL_PWD']}")
    wait_until_idle(run_dir / "passes" / "1")
    assert "pass 1: merged, 3 rows" in cli("status", str(run_dir))
    # the pass's task got DATABASE_URL's value (the unit test of K3 is test_exact_records: this
    # end-to-end check also passed before that fix, so redo's path did not show the fault)
    pass_logs = "".join(p.read_text(errors="replace") for p in (run_dir / "passes" / "1" / "logs").rglob("*_log.*"))
    assert f"db-url-{sha(DATABASE_URL)}" in pass_logs and f"db-url-{sha('<redacted>')}" not in pass_logs
    cli("cancel", str(run_dir))
    cli("tune", *ov, "--rows", "8", "--try", "defaults", "--out", str(tune), "--no-wait")
    cli("status", str(tune), "--json")
    cli("cancel", str(tune))
    assert (tune / "job.json").is_file() and list((tune / "logs").rglob("*.sh"))
    # `literal` holds HF's value as typed, in a shell where it is no secret: run.yaml holds what runs
    files = [p for d in (run_dir, tune) for p in d.rglob("*") if p.is_file() and not p.is_symlink()]
    files += sorted(SLURM_LOGS.glob("*.log"))
    hits = [f"{p}: {s}" for p in files for s in PLANTED if s.encode() in p.read_bytes()]
    hits += [f"`{cmd}`: {s}" for cmd, text in printed.items() for s in PLANTED if s in text]
    print(f"planted secrets searched in {len(files)} files and {len(printed)} outputs: {len(hits)} hits")
    assert len(files) > 30 and not hits, hits
