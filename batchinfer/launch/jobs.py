"""The submissions recorded in DIR/jobs.jsonl, the array task each shard was given to, and the
Slurm states of a run's jobs."""

from __future__ import annotations

import json
import logging
from typing import NotRequired, Optional, TypedDict

from batchinfer.launch import slurm
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")


class ArrayRecord(TypedDict):
    """One array of a submission: its Slurm job id, and array index (as a JSON key) -> shards."""

    job_id: str
    tasks: dict[str, list[int]]


class JobsLine(TypedDict, total=False):
    """One line of DIR/jobs.jsonl: a submission's start (time, folder, name, arrays_planned, heal),
    one array (array, job_id, tasks), or its merge job (merge); a line of an earlier version holds a
    whole submission (arrays, merge). Every line has `submission`."""

    submission: int
    time: float
    folder: str
    name: str
    arrays_planned: int
    heal: bool
    array: int
    job_id: str
    tasks: dict[str, list[int]]
    arrays: list[ArrayRecord]
    merge: Optional[str]


class Submission(TypedDict):
    """A submission folded from its lines of jobs.jsonl (submissions)."""

    submission: int
    time: Optional[float]
    folder: Optional[str]
    name: Optional[str]
    arrays: list[ArrayRecord]
    merge: Optional[str]  # None until submitted
    heal: bool  # made by the merge job's `heal`, not by a user's submit or resume
    arrays_planned: NotRequired[int]
    complete: bool  # the merge job was submitted


class ShardTask(TypedDict):
    """The latest array task a shard was given to (shard_tasks)."""

    job: str  # ARRAY_TASK
    folder: Optional[str]  # its submission's log folder
    submission: int


def submissions(run: RunDir) -> list[Submission]:
    """Submissions recorded in DIR/jobs.jsonl, oldest first, each folded from its lines.

    A submission writes a line as it starts (time, log folder, job name), one per array as soon as
    sbatch returns its id, and one for the merge job; files of earlier versions hold one line per
    submission with "arrays" and "merge". Each record has submission, time, folder, name, arrays
    ([{job_id, tasks}]), merge (None until submitted), complete (the merge job was submitted) and
    heal (made by the merge job's `heal`, not by a user's submit or resume)."""
    path = run.path / "jobs.jsonl"
    if not path.is_file():
        return []
    folded: dict[int, Submission] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # blank, or the torn last line of a submit killed while writing it
        if not isinstance(rec, dict) or "submission" not in rec:
            continue
        rec = _checked(rec, f"{path}:{number}")
        sub = folded.setdefault(
            rec["submission"],
            {  # type: ignore[typeddict-item]  # `complete` is set once every line is read
                "submission": rec["submission"],
                "time": None,
                "folder": None,
                "name": None,
                "arrays": [],
                "merge": None,
                "heal": False,
            },
        )
        sub["heal"] = sub["heal"] or bool(rec.get("heal"))
        for key in ("time", "folder", "name", "arrays_planned"):
            if key in rec:
                sub[key] = rec[key]  # type: ignore[literal-required]
        sub["arrays"] += [{"job_id": str(a["job_id"]), "tasks": a["tasks"]} for a in rec["arrays"]]
        if rec.get("merge"):
            sub["merge"] = rec["merge"]
    out = [folded[n] for n in sorted(folded)]
    for sub in out:
        sub["complete"] = sub["merge"] is not None
    return out


def _checked(rec: JobsLine, where: str) -> JobsLine:
    """rec without the job ids and names that are not Slurm's (anyone who can write DIR can write
    this file: a value like `--user=root` must never reach scancel, squeue or sacct)."""
    out = JobsLine(**rec)
    dropped = []
    arrays = [rec] if "job_id" in rec else []
    arrays += [a for a in rec.get("arrays") or [] if isinstance(a, dict)]
    kept = [a for a in arrays if slurm.is_job_id(a.get("job_id")) and isinstance(a.get("tasks"), dict)]
    dropped += [repr(a.get("job_id")) for a in arrays if a not in kept]
    out.pop("job_id", None)
    out["arrays"] = kept
    if rec.get("merge") and not slurm.is_job_id(rec["merge"]):
        dropped.append(repr(rec["merge"]))
        out["merge"] = None
    if rec.get("name") and not slurm.is_job_name(rec["name"]):
        dropped.append(repr(rec["name"]))
        out.pop("name")
    if dropped:
        log.warning("%s: ignored %s: not a Slurm job id or job name", where, ", ".join(dropped))
    return out


def heal_streak(subs: list[Submission]) -> int:
    """How many of the latest submissions (submissions(run)) in a row were made by `heal`."""
    streak = 0
    for sub in reversed(subs):
        if not sub["heal"]:
            break
        streak += 1
    return streak


def shard_tasks(run: RunDir, subs: Optional[list[Submission]] = None) -> dict[int, ShardTask]:
    """The latest array task each shard was given to: job id, log folder, submission.

    subs: submissions(run) when the caller has read them already."""
    out: dict[int, ShardTask] = {}
    for sub in submissions(run) if subs is None else subs:
        for array in sub["arrays"]:
            for index, shards in array["tasks"].items():
                for shard in shards:
                    out[shard] = ShardTask(
                        job=f"{array['job_id']}_{index}", folder=sub["folder"], submission=sub["submission"]
                    )
    return out


def all_job_ids(run: RunDir, subs: Optional[list[Submission]] = None) -> list[str]:
    """Every array and merge job id recorded for DIR (subs: submissions(run), if read already)."""
    ids = []
    for sub in submissions(run) if subs is None else subs:
        ids += [a["job_id"] for a in sub["arrays"]]
        if sub.get("merge"):
            ids.append(sub["merge"])
    return ids


def unrecorded_names(run: RunDir, subs: Optional[list[Submission]] = None) -> list[str]:
    """Job names of submissions cut short (sbatch refused, timed out, or submit was killed):
    jobs of theirs may exist whose ids were never recorded. subs: submissions(run), if read already."""
    return [s["name"] for s in (submissions(run) if subs is None else subs) if not s["complete"] and s.get("name")]


def slurm_states(
    run: RunDir, nodes: Optional[dict[str, str]] = None
) -> tuple[dict[str, str], dict[str, str], Optional[str]]:
    """(states of DIR's jobs, jobs found only by their submission's name, a note when Slurm did not
    answer); a `nodes` dict gets each task's nodes (slurm.job_states). Never raises for Slurm:
    status shows what the run directory knows without it."""
    subs = submissions(run)
    # array ids, not their tasks': job_states answers for every task of an array asked about
    ids = sorted(set(all_job_ids(run, subs)))
    names = unrecorded_names(run, subs)
    problems: list[str] = []
    states = slurm.job_states(ids, names=names, problems=problems, nodes=nodes) if ids or names else {}
    known = set(ids)
    unrecorded = {j: s for j, s in states.items() if j not in known and j.split("_")[0] not in known}
    note = None
    if problems:
        answered = {"sacct", "squeue"} - {p.split(":")[0] for p in problems}
        source = "the run directory" + (f" and {' and '.join(sorted(answered))}" if answered and ids else " only")
        note = f"Slurm did not answer ({'; '.join(problems)}); states come from {source}"
    return states, unrecorded, note
