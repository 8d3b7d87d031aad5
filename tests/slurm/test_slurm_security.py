"""Shared-cluster safety on the real dev cluster: secrets by environment only, modes, hostile names
(the tasks run the stand-in engine: tests/support/standin.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
from pathlib import Path

import pytest
import yaml
from support.corpus import project, read_output, write_rows
from support.procs import run_cli
from support.slurm import REPO, cluster_overrides, wait_until_idle
from support.standin import StandinEngine, standin_env

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.slurm, pytest.mark.engine]
HF = "hf_PLANTED1234567890"
API = "sk_PLANTEDapi0987654321"
SLURM_LOGS = Path("/tmp/batchinfer-slurm/cluster/log")
# The jobs import this checkout's batchinfer (sbatch's --export=ALL carries PYTHONPATH).
ENV = {"PYTHONPATH": str(REPO)}


def modes(d: Path) -> dict[Path, int]:
    """Permission bits of d and everything in it (symlinks left out)."""
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in [d, *d.rglob("*")] if not p.is_symlink()}


def logs_text(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.*"))


def test_secrets_reach_jobs_only_through_the_environment(
    slurm_env: dict,
    tmp_path: Path,
    tiny_model_path: Path,
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = [{"id": f"r{i}", "text": f"dog fox {i}"} for i in range(12)]
    write_rows(corpus, rows)
    run_dir = tmp_path / "run"
    # Hashes prove the exact values arrived without writing them anywhere.
    setup = (
        "cluster.setup=['printf %s \"$HF_TOKEN\" | sha256sum | sed s/^/hf-token-/', "
        "'printf %s \"$WANDB_API_KEY\" | sha256sum | sed s/^/api-key-/', "
        "'python -c \"import batchinfer; print(\\'imports\\', batchinfer.__file__)\"']"
    )
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, "sampling.max_tokens=4", "output.private=true", setup)
    res = run_cli(
        ["submit", *ov, f"+cluster.env.WANDB_API_KEY={API}"],
        env=standin_env(dict(os.environ, **ENV, HF_TOKEN=HF)),
        preexec_fn=lambda: os.umask(0o022),
    )
    assert res.returncode == 0, res.stderr
    wait_until_idle(run_dir)
    assert [r["id"] for r in read_output(run_dir)] == [r["id"] for r in rows]
    logs = logs_text(run_dir)
    for prefix, token in (("hf-token", HF), ("api-key", API)):
        assert f"{prefix}-{hashlib.sha256(token.encode()).hexdigest()}" in logs, logs[-3000:]
    assert f"imports {REPO}/batchinfer/__init__.py" in logs
    assert "WANDB_API_KEY: <redacted>" in (run_dir / "run.yaml").read_text()
    status = run_cli(["status", str(run_dir)], env=ENV)
    # Every file of DIR (sbatch scripts, submitit pickles, Slurm logs, parts, output, stats) and Slurm's own logs.
    files = [p for p in run_dir.rglob("*") if p.is_file()] + sorted(SLURM_LOGS.glob("*.log"))
    hits = [str(p) for p in files for t in (HF, API) if t.encode() in p.read_bytes()]
    hits += [name for name, text in (("submit", res.stdout + res.stderr), ("status", status.stdout)) if HF in text]
    print(f"planted tokens searched in {len(files)} files and the command output: {len(hits)} hits")
    assert len(files) > 20 and not hits, hits
    # output.private=true: user-private whatever the umask, logs and scripts included.
    wrong = {str(p): oct(m) for p, m in modes(run_dir).items() if m != (0o700 if p.is_dir() else 0o600)}
    assert not wrong, wrong


WEIRD = "we ird 'q' \"dq\" $(touch /tmp/pwned-XYZ) `touch /tmp/pwned-XYZ`"
IDS = ["a b", "it's", 'dq"', "$(touch /tmp/pwned-XYZ)", "`touch /tmp/pwned-XYZ`", "line\nbreak", "x; rm -rf ~"]
TEMPLATE = "$(touch /tmp/pwned-XYZ) `id` 'q' \"d\" ${{H}}\n{text}"  # short: max_model_len is 128
SYSTEM = "$(id) `id` 'q' \"d\"\nok"


def test_hostile_paths_ids_and_templates_go_through_untouched(
    slurm_env: dict,
    tmp_path: Path,
    tiny_model_path: Path,
) -> None:
    pwned = Path("/tmp/pwned-XYZ")
    pwned.unlink(missing_ok=True)
    base = tmp_path / WEIRD  # the / in the $(...) make it nested folders: the full path holds the text
    corpus = base / f"in {WEIRD}.jsonl"
    corpus.parent.mkdir(parents=True)
    rows = [{"id": i, "text": f"dog fox {n}"} for n, i in enumerate(IDS)]
    write_rows(corpus, rows)
    out = base / f"out {WEIRD}"
    extra = ["sharding.num_shards=2", "sampling.max_tokens=4", f"prompt.template={TEMPLATE}", f"prompt.system={SYSTEM}"]
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, *extra, out=out)
    res = run_cli(["submit", *ov], env=standin_env(dict(os.environ, **ENV)), preexec_fn=lambda: os.umask(0o027))
    assert res.returncode == 0, res.stderr
    assert f"batchinfer status {shlex.quote(str(out))}" in res.stdout  # commands print ready to paste
    wait_until_idle(out)
    got = read_output(out)
    assert [r["id"] for r in got] == IDS and all(r["error"] is None for r in got), got
    config = yaml.safe_load((out / "run.yaml").read_text())["config"]
    assert config["prompt"]["template"] == TEMPLATE and config["prompt"]["system"] == SYSTEM
    assert config["input"]["path"] == str(corpus) and config["output"]["dir"] == str(out)
    local = compose([*ov, "cluster=local", f"output.dir={tmp_path}/clean"])
    clean = run_local(local, engine=StandinEngine(local))
    assert project(got) == project(read_output(clean.path))  # same prompt tokens: the prompt as given
    status = run_cli(["status", str(out), "--json"], env=ENV)
    assert status.returncode == 0 and json.loads(status.stdout)["totals"]["states"] == {"done": 2}
    assert not pwned.exists()
    # umask 027 honoured: nothing is more open than it allows; the files people read are exactly 0640.
    found = modes(out)
    assert not {str(p): oct(m) for p, m in found.items() if m & 0o027}
    for p in [out / "run.yaml", out / "output.parquet", *out.glob("shards/*/rows.*"), *out.rglob("*_log.*")]:
        assert found[p] == 0o640, (p, oct(found[p]))
    assert found[out] == 0o750 and found[out / "logs"] == 0o750
