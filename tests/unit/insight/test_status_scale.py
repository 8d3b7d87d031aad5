"""`status` of many shards, against fake sacct/squeue on PATH (no cluster, no engine): sacct is
asked about array job ids and its task lines (pending ranges, requeued tasks) come back per
shard; a failed task's error line comes from its own log, opened by name, with the log folder
never listed, and read once per task from its end."""

from __future__ import annotations

import io
import json
import os
import signal
import stat
from pathlib import Path
from typing import Any, Optional

import pytest
from support.corpus import write_corpus
from support.log_handlers import restored_log_handlers
from support.runs import fake_model_dir

from batchinfer.cli import main
from batchinfer.config.compose import compose
from batchinfer.durable import write_json
from batchinfer.insight import status
from batchinfer.launch import slurm
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

# Arrays 100 (shards 0-2) and 101 (shards 3-5), a one-task array submitted as the plain job 103
# (shard 6, recorded as task 103_0), the merge job 102.
ARRAYS = [
    {"submission": 0, "array": 0, "job_id": "100", "tasks": {"0": [0], "1": [1], "2": [2]}},
    {"submission": 0, "array": 1, "job_id": "101", "tasks": {"0": [3], "1": [4], "2": [5]}},
    {"submission": 1, "array": 0, "job_id": "103", "tasks": {"0": [6]}},
]
SACCT = """100_0|COMPLETED
100_1|FAILED
100_2|REQUEUED
100_2|RUNNING
101_0|CANCELLED by 1000
101_[1-2%1]|PENDING
102|PENDING
103|FAILED
"""


@pytest.fixture(autouse=True)
def own_log_handlers() -> Any:
    """setup_logging (run by main) binds a handler to this test's captured stderr: undo it after."""
    yield from restored_log_handlers()


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A folder first on PATH; fake(name, output) writes a script there that appends its
    arguments to NAME.calls and prints output."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    def fake(name: str, output: str = "") -> Path:
        (folder / f"{name}.out").write_text(output)
        path = folder / name
        path.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$0.calls"\ncat "$0.out"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    fake("sacct")
    fake("squeue")
    fake.calls = lambda name: (folder / f"{name}.calls").read_text().splitlines()  # type: ignore[attr-defined]
    return fake


def cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """batchinfer's main in this process; its USR2 block is undone for the tests after it."""
    try:
        code = main(args)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out


def prepared_run(tmp_path: Path) -> RunDir:
    """7 shards of 2 rows, nothing submitted yet; log folders for submissions 0 and 1."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 14)
    cfg = compose(
        [
            f"input.path={corpus}",
            "input.id_column=id",
            f"model.path={fake_model_dir(tmp_path)}",
            f"output.dir={tmp_path}/run",
            "cluster=slurm",
            "sharding.num_shards=7",
        ]
    )
    run = prepare(cfg)
    for n in (0, 1):
        (run.logs_dir / f"submission-{n:03d}").mkdir(parents=True)
    return run


def write_jobs(run: RunDir, arrays: list[dict[str, Any]], merges: dict[int, str]) -> None:
    """DIR/jobs.jsonl as submit writes it: a line per submission, per array, per merge job."""
    lines: list[dict[str, Any]] = []
    for n in sorted({a["submission"] for a in arrays}):
        folder = run.logs_dir / f"submission-{n:03d}"
        lines.append({"submission": n, "time": 1.0 + n, "folder": str(folder), "name": f"bi-x-{n}"})
        lines += [a for a in arrays if a["submission"] == n]
        if n in merges:
            lines.append({"submission": n, "merge": merges[n]})
    (run.path / "jobs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def submitted_run(tmp_path: Path) -> RunDir:
    """prepared_run given to the arrays of ARRAYS; shard 0 done, shard 2 half way."""
    run = prepared_run(tmp_path)
    write_jobs(run, ARRAYS, {0: "102"})
    for index in (0, 2):
        run.shard_dir(index).mkdir(parents=True)
    write_json(
        run.shard_folder(0).done_path, {"rows_done": 2, "output_tokens": 8, "seconds": {"generate": 2.0}, "attempts": 1}
    )
    write_json(
        run.shard_folder(2).progress_path,
        {"rows_done": 1, "output_tokens": 4, "seconds": {"generate": 2.0}, "attempts": 2, "updated": 5.0},
    )
    return run


def sacct_ids(calls: list[str]) -> list[str]:
    """The job ids of every `sacct ... -j IDS` call, in order."""
    ids = []
    for call in calls:
        args = call.split()
        ids += args[args.index("-j") + 1].split(",")
    return ids


def test_sacct_is_asked_per_array_job_never_per_task(
    tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = submitted_run(tmp_path)
    fake_bin("sacct", SACCT)
    reads = []
    real_read_text = Path.read_text

    def counting_read_text(self: Path, *a: Any, **k: Any) -> str:
        if self.name == "jobs.jsonl":
            reads.append(self)
        return real_read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    code, _ = cli(["status", str(run.path)], capsys)
    assert code == 0
    calls = fake_bin.calls("sacct")
    ids = sacct_ids(calls)
    # the two arrays, the one-task array (a plain job) and the merge job, each once; no A_T
    assert sorted(ids) == ["100", "101", "102", "103"], calls
    assert all(call.startswith("-n -P -X -o JobID,State,ExitCode,NodeList -j ") for call in calls)
    assert len(fake_bin.calls("squeue")) == 1
    assert len(reads) <= 2  # once for Slurm's ids, once for the shards' tasks: not per shard


def test_task_states_per_shard_from_array_lines(tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture) -> None:
    run = submitted_run(tmp_path)
    fake_bin("sacct", SACCT)
    code, out = cli(["status", str(run.path), "--json"], capsys)
    assert code == 0
    shards = json.loads(out)["shards"]
    got = [(s["shard"], s["job"], s["job_state"], s["state"]) for s in shards]
    assert got == [
        (0, "100_0", "COMPLETED", "done"),
        (1, "100_1", "FAILED", "failed"),
        (2, "100_2", "RUNNING", "running"),  # requeued, then running again: its latest line wins
        (3, "101_0", "CANCELLED", "failed"),
        (4, "101_1", "PENDING", "pending"),  # from the range line 101_[1-2%1]
        (5, "101_2", "PENDING", "pending"),
        (6, "103_0", "FAILED", "failed"),  # a one-task array: Slurm knows it as the job 103
    ]
    # squeue knows live tasks better than accounting does: its line wins over sacct's range
    fake_bin("squeue", "101_1|101|RUNNING|bi-x-0\n555_0|555|RUNNING|someone-else\n")
    code, out = cli(["status", str(run.path)], capsys)
    lines = out.splitlines()
    assert lines[2].split() == ["0", "done", "2", "of", "2", "4.0", "100_0", "1"]
    assert lines[4].split()[:6] == ["2", "running", "1", "of", "2", "2.0"]
    assert lines[6].split()[:2] == ["4", "running"] and lines[7].split()[:2] == ["5", "pending"]
    assert "shards: 1 done, 3 failed, 1 pending, 2 running" in out and "555" not in out


def test_job_states_reads_ranges_throttles_steps_and_requeues(fake_bin: Any) -> None:
    fake_bin(
        "sacct",
        "7_[0-2,5,9-13:2%3]|PENDING\n"  # tasks 0 1 2 5 9 11 13, at most 3 at once
        "7_1|REQUEUED\n"  # a task's own line beats the range, before it or after it
        "7_4|COMPLETED\n"
        "7_4|OUT_OF_MEMORY\n"  # two runs of a requeued task (sacct -D): the later one
        "8_[x-y]|PENDING\n"  # a form not known: skipped, not fatal
        "8_3|TIMEOUT\n",
    )
    problems: list[str] = []
    states = slurm.job_states(["7", "8_3", "8_5"], problems=problems)
    assert problems == []
    assert states == {
        "7_0": "PENDING",
        "7_1": "REQUEUED",
        "7_2": "PENDING",
        "7_4": "OUT_OF_MEMORY",
        "7_5": "PENDING",
        "7_9": "PENDING",
        "7_11": "PENDING",
        "7_13": "PENDING",
        "8_3": "TIMEOUT",
    }
    assert sacct_ids(fake_bin.calls("sacct")) == ["7", "8"]


def forbid_listing(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Listing folder or anything under it, in any of the ways Python offers, fails the test."""

    def guarded(real: Any) -> Any:
        def call(target: Any = ".", *a: Any, **k: Any) -> Any:
            if str(target).startswith(str(folder)):
                raise AssertionError(f"listed {target}")
            return real(target, *a, **k)

        return call

    for name in ("glob", "rglob", "iterdir"):
        monkeypatch.setattr(Path, name, guarded(getattr(Path, name)))
    monkeypatch.setattr(os, "scandir", guarded(os.scandir))
    monkeypatch.setattr(os, "listdir", guarded(os.listdir))


def test_last_error_line_comes_from_the_tasks_own_log_by_name(
    tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = submitted_run(tmp_path)
    fake_bin("sacct", SACCT)
    logs = run.logs_dir / "submission-000"
    for i in range(300):  # other tasks' logs, some with names that start like the failed task's
        for suffix in ("log.err", "log.out", "result.pkl"):
            (logs / f"100_1{i}_0_{suffix}").write_text(f"RuntimeError: task 100_1{i}\n")
    (logs / "100_1_0_log.out").write_text("ValueError: stdout is not where errors are read\n")
    (logs / "100_1_0_log.err").write_text(
        "INFO loading model\nRuntimeError: CUDA error: out of memory\nINFO shutting down\n"
    )
    (logs / "101_0_0_log.err").write_text("INFO starting\nslurmstepd: error: *** JOB 101 CANCELLED AT 12:00 ***\n")
    (run.logs_dir / "submission-001" / "103_0_log.err").write_text("EngineDeadError: engine core died\nbye\n")
    forbid_listing(monkeypatch, run.logs_dir)
    code, out = cli(["status", str(run.path)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[3].split()[:2] == ["1", "failed"] and lines[3].endswith("RuntimeError: CUDA error: out of memory")
    assert lines[5].split()[:2] == ["3", "failed"]
    assert lines[5].endswith("slurmstepd: error: *** JOB 101 CANCELLED AT 12:00 ***")
    assert lines[8].split()[:2] == ["6", "failed"] and lines[8].endswith("EngineDeadError: engine core died")
    code, out = cli(["status", str(run.path), "--json"], capsys)
    logged = {s["shard"]: s.get("log") for s in json.loads(out)["shards"]}
    assert logged[1] == "RuntimeError: CUDA error: out of memory" and logged[2] is None


def old_last_error_line(text: str) -> Optional[str]:
    """What status reported before it read logs backwards: the whole text's last error-like line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "Killed" in ln or "CANCELLED" in ln]
    return (errors or lines or [None])[-1]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n  \n",
        "one line, no newline",
        "INFO a\nValueError: bad row\nINFO b\nINFO c\n",
        "Processed prompts:  10%|#\rProcessed prompts:  20%|##\rRuntimeError: déjà vu ✓ in a tqdm line\rdone 100%\n",
        "é" * 40 + "\nKilled\n" + "ü✓" * 30 + "\n",  # multi-byte characters across block boundaries
        "RuntimeError: first\n" + "INFO progress line\n" * 50 + "last line without error",
        "error: no newline at the end",
    ],
    ids=["empty", "blank", "one-line", "error-mid", "tqdm-cr", "multibyte", "error-far-back", "no-newline"],
)
def test_a_tasks_log_is_read_once_from_its_end_like_reading_it_whole(
    tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared_run(tmp_path)
    write_jobs(run, [{"submission": 0, "array": 0, "job_id": "100", "tasks": {"1": [0, 1, 2]}}], {})
    (run.logs_dir / "submission-000" / "100_1_0_log.err").write_text(text)
    monkeypatch.setattr(status, "LOG_BLOCK_BYTES", 7, raising=False)  # lines cut by block boundaries
    opened: list[str] = []
    real_open = io.open

    def counting_open(file: Any, *a: Any, **k: Any) -> Any:
        if str(file).endswith("_log.err"):
            opened.append(Path(file).name)
        return real_open(file, *a, **k)

    monkeypatch.setattr(io, "open", counting_open)
    records = status.shard_status(run, {"100_1": "FAILED"})
    assert [r["state"] for r in records[:3]] == ["failed"] * 3
    assert [r["log"] for r in records[:3]] == [old_last_error_line(text)] * 3
    assert opened.count("100_1_0_log.err") == 1


def test_a_log_is_read_no_further_back_than_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "100_1_0_log.err"
    log.write_text("RuntimeError: long ago\n" + "INFO progress line\n" * 20 + "INFO the end\n")
    monkeypatch.setattr(status, "LOG_BLOCK_BYTES", 16, raising=False)
    monkeypatch.setattr(status, "LOG_SCAN_BYTES", 64, raising=False)
    assert status.last_error_line(tmp_path, "100_1") == "INFO the end"  # not the whole file's
    monkeypatch.setattr(status, "LOG_SCAN_BYTES", 10**6, raising=False)
    assert status.last_error_line(tmp_path, "100_1") == "RuntimeError: long ago"
