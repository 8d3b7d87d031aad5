"""A tune folder's Slurm job (`tune ... cluster=slurm`): its record TUNE/job.json, its state, and
what `status TUNE` and `cancel TUNE` do with it."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchinfer import slurm_states
from batchinfer.errors import RunDirError
from batchinfer.launch import slurm
from batchinfer.redaction import exact_json, record_json

JOB_FILE = "job.json"
RESULT_FILE = "tune.json"


@dataclass
class TuneJob:
    """TUNE/job.json: written before sbatch (the job name: `cancel` finds a job whose id sbatch
    never returned), then again with the job id."""

    name: str
    logs: str  # submitit's folder: scripts and the job's stdout/stderr
    submitted: float
    time_minutes: int
    request: dict[str, Any] = field(default_factory=dict)  # cwd, overrides, config_dir, options
    job_id: Optional[str] = None

    def log_path(self) -> Optional[Path]:
        """The job's stderr (submitit names a plain job's log `<id>_0_log.err`)."""
        return Path(self.logs) / f"{self.job_id}_0_log.err" if self.job_id else None


def write_record(folder: Path, job: TuneJob) -> None:
    """TUNE/job.json, written atomically: the job composes from it, so it holds the overrides exactly
    but a secret-named key's value (redaction.exact_json), owner-only when it marks a secret's place."""
    from batchinfer.durable import write_record as write_text_record

    write_text_record(folder / JOB_FILE, exact_json(asdict(job), indent=2) + "\n")


def read_record(folder: Path) -> Optional[TuneJob]:
    """TUNE/job.json, or None for a tune run here (no job)."""
    path = folder / JOB_FILE
    if not path.is_file():
        return None
    try:
        return TuneJob(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as e:
        raise RunDirError(f"{path}: not a tune job record ({e}); the job's log folder is {folder / 'logs'}") from None


def is_tune_folder(path: str) -> bool:
    """A folder `batchinfer tune` made (its job record or its result), not a run directory."""
    p = Path(path)
    return not (p / "run.yaml").exists() and ((p / JOB_FILE).is_file() or (p / RESULT_FILE).is_file())


@dataclass
class JobState:
    """Where a tune folder stands: its job's Slurm state and whether its result is written."""

    folder: str
    job_id: Optional[str]
    state: Optional[str]  # None: no job (a local tune), or Slurm does not know it (yet)
    done: bool  # tune.json is there (and newer than the job's submission)
    error: Optional[str] = None  # the job's log's last error line, when it ended without a result
    log: Optional[str] = None
    note: Optional[str] = None  # Slurm did not answer

    @property
    def active(self) -> bool:
        """The job is queued or running."""
        return self.state in slurm_states.ACTIVE


def result_written(folder: Path, job: Optional[TuneJob]) -> bool:
    """tune.json is there, and written after this job was submitted (not a stale one)."""
    path = folder / RESULT_FILE
    return path.is_file() and (job is None or path.stat().st_mtime >= job.submitted)


def job_state(folder: Path) -> JobState:
    """The tune folder's job state (sacct/squeue), its result, and the error of a job that failed."""
    from batchinfer.insight.status import last_error_line

    job = read_record(folder)
    done = result_written(folder, job)
    if job is None:
        return JobState(str(folder), None, None, done)
    problems: list[str] = []
    states = slurm.job_states(
        [job.job_id] if job.job_id else [], names=[] if job.job_id else [job.name], problems=problems
    )
    state = states.get(job.job_id) if job.job_id else next(iter(states.values()), None)
    st = JobState(str(folder), job.job_id, state, done, log=str(job.log_path()) if job.job_id else None)
    st.note = "; ".join(problems) or None
    if not done and state in slurm_states.FINAL and job.job_id:
        st.error = last_error_line(Path(job.logs), f"{job.job_id}_0") or f"no log at {job.log_path()}"
    return st


def format_state(st: JobState) -> str:
    """`status TUNE` for people."""
    shown = shlex.quote(st.folder)
    if st.job_id is None and st.state is None and st.done:
        return f"{st.folder}: a tune run here, finished; the table is {st.folder}/tune.md"
    lines = [f"{st.folder}: tune job {st.job_id or '(id not recorded)'} {st.state or 'unknown to Slurm'}"]
    trials = sorted((Path(st.folder) / "trials").glob("[0-9]*"))
    if trials:
        lines.append(f"  settings started: {len(trials)}; each trial's log: {st.folder}/trials/NN/trial.log")
    if st.done:
        lines.append(f"  finished: {st.folder}/tune.md, tune.png, tune.json, conf/tuned/best.yaml")
    elif st.error:
        lines.append(f"  ended without a result: {st.error}")
    if st.log:
        lines.append(f"  job log: {st.log}")
    if st.active:
        lines.append(f"  cancel:  batchinfer cancel {shown}")
    if st.note:
        lines.append(f"  Slurm did not answer ({st.note}): the state may be out of date")
    return "\n".join(lines)


def show_status(path: str, as_json: bool) -> int:
    """`batchinfer status TUNE`: the job's state; the result's table once it is written."""
    from batchinfer.tune.results import format_result

    folder = Path(path).resolve()
    st = job_state(folder)
    result = json.loads((folder / RESULT_FILE).read_text(encoding="utf-8")) if st.done else None
    if as_json:
        print(record_json({"dir": str(folder), "kind": "tune", **asdict(st), "result": result}, indent=2))
        return 0
    print(format_state(st))
    if result is not None:
        print()
        print(format_result(result))
    return 0


def cancel(path: str) -> list[str]:
    """`batchinfer cancel TUNE`: scancel its job (by name too when sbatch returned no id)."""
    folder = Path(path).resolve()
    job = read_record(folder)
    if job is None:
        print(f"{folder}: a tune run here, no job to cancel")
        return []
    ids = [job.job_id] if job.job_id else []
    missed = slurm.cancel(ids, [] if ids else [job.name])
    if missed:
        print(f"the tune job of {folder} was not cancelled: " + ", ".join(f"{j} ({r})" for j, r in missed.items()))
        return []
    print(f"cancelled the tune job of {folder}: {job.job_id or 'any job named ' + job.name}")
    return ids


def wait_seconds(submitted: float) -> float:
    """How long to sleep between polls: short at first (a small tune ends in minutes), then 30 s."""
    return 5.0 if time.time() - submitted < 600 else 30.0
