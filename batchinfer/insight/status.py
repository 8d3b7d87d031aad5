"""`status`: per-shard state from the run directory plus squeue/sacct, totals, tokens/s, ETA."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import NotRequired, Optional, TypedDict

from batchinfer import slurm_states
from batchinfer.config.schema import POOLING_TASKS
from batchinfer.insight.task_nodes import nodes_note, shard_nodes
from batchinfer.launch.jobs import shard_tasks
from batchinfer.rundir.progress import EngineSlot, Progress, ProgressRecord, budget_key, engine_record
from batchinfer.rundir.store import RunDir

# A failed task's log is read from its end in blocks until a line looks like an error, and no
# further back than this: a vLLM task's stderr can be large, and many tasks can fail at once.
LOG_BLOCK_BYTES = 64 * 1024
LOG_SCAN_BYTES = 4 * 1024 * 1024


class ShardState(TypedDict):
    """One shard's line of `status` (`status --json`'s `shards`)."""

    shard: int
    rows: int
    rows_done: int
    output_tokens: int
    reused_rows: int  # answered from output.reuse
    generate_seconds: float
    output_tokens_per_s: Optional[float]
    total_tokens_per_s: Optional[float]
    rows_per_s: Optional[float]
    updated: Optional[float]
    attempts: int
    failures: int
    engine: Optional[EngineSlot]  # which of its task's engines; None: the only one
    failures_this_submission: NotRequired[int]  # cluster.max_attempts counts per submission
    adapter_loads: NotRequired[int]  # LoRA runs: adapters the engine moved into a slot for this shard
    job: Optional[str]
    job_state: Optional[str]
    state: str  # done, running, pending, failed or partial
    nodes: Optional[str]
    error: NotRequired[Optional[str]]  # a failed shard's: its last error, else its log's
    log: NotRequired[Optional[str]]


class StatusTotals(TypedDict):
    """`status`'s total line (`status --json`'s `totals`): summarize."""

    shards: int
    states: dict[str, int]
    rows: int
    rows_done: int
    reused_rows: int
    output_tokens: int
    output_tokens_per_s: Optional[float]
    rows_per_s: Optional[float]
    running_tasks: int
    running_output_tokens_per_s: Optional[float]
    running_rows_per_s: Optional[float]
    eta_seconds: Optional[int]
    time: str
    adapter_loads: NotRequired[int]  # LoRA runs: over the shards that count them


def task_log_paths(folder: Path, job: str) -> list[Path]:
    """The stderr logs submitit names for an array task A_T (`A_T_0_log.err`, from `%A_%a_%t`)
    and, for a one-task array submitted as the plain job A (recorded as A_0), `A_0_log.err`."""
    paths = [folder / f"{job}_0_log.err"]
    array, _, index = job.rpartition("_")
    if array and index == "0":
        paths.append(folder / f"{array}_0_log.err")
    return sorted(paths)


def _is_error(line: str) -> bool:
    return "error" in line.lower() or "Killed" in line or "CANCELLED" in line


def _scan_log(path: Path) -> tuple[Optional[str], Optional[str]]:
    """(last line that looks like an error, last line) of a log, read backwards from its end."""
    try:
        f = path.open("rb")
    except OSError:
        return None, None
    with f:
        end = pos = f.seek(0, os.SEEK_END)
        last: Optional[str] = None
        carry = b""  # the start of a line cut by a block boundary, finished by the block before it
        while pos > 0 and end - pos < LOG_SCAN_BYTES:
            step = min(LOG_BLOCK_BYTES, pos)
            pos -= step
            f.seek(pos)
            pieces = (f.read(step) + carry).split(b"\n")
            carry = pieces.pop(0) if pos > 0 else b""
            for piece in reversed(pieces):
                # splitlines as before: tqdm's \r-separated progress counts as lines too
                for line in reversed(piece.decode(errors="replace").splitlines()):
                    line = line.strip()
                    if line:
                        last = last or line
                        if _is_error(line):
                            return line, last
    return None, last


def last_error_line(folder: Path, job: str) -> Optional[str]:
    """The last line of a task's stderr log that looks like an error, else its last line.

    Only the log files named for this task are opened: the log folder of a large run holds tens
    of thousands of files, and listing it on a shared filesystem costs more than the rest of status."""
    last = None
    for path in reversed(task_log_paths(folder, job)):  # as if the logs were one text, in name order
        found, tail = _scan_log(path)
        if found:
            return found
        last = last or tail
    return last


def _progress(run: RunDir, index: int, names: tuple[str, str]) -> tuple[bool, ProgressRecord]:
    """(done, the shard's DONE.json, else progress.json, else {}); names: those two files' names.

    Opened, not stat-ed first: a shard costs one or two metadata calls on a shared filesystem, not four."""
    folder = os.fspath(run.shard_dir(index))  # one Path per shard, not four: 10,000 of them add up
    for done, name in ((True, names[0]), (False, names[1])):
        try:
            with open(os.path.join(folder, name), "rb") as f:
                return done, json.loads(f.read())
        except FileNotFoundError:
            continue
    return False, {}


def shard_status(run: RunDir, states: dict[str, str], nodes: Optional[dict[str, str]] = None) -> list[ShardState]:
    """One record per shard: state, rows done of total, tokens, attempts, last error; the nodes of
    a running or failed shard's task (nodes: task -> sacct's NodeList)."""
    tasks = shard_tasks(run)
    log_lines: dict[str, Optional[str]] = {}  # a task's shards share its log: read it once
    names = (run.shard_folder(0).done_path.name, run.shard_folder(0).progress_path.name)
    out = []
    for shard in run.shards():
        rec: ShardState = {"shard": shard.index, "rows": shard.rows, "rows_done": 0, "output_tokens": 0}  # type: ignore[typeddict-item]
        done, raw = _progress(run, shard.index, names)
        progress = Progress.from_dict(raw)
        gen = progress.seconds.generate
        rates = progress.rates()
        rec.update(
            rows_done=progress.rows_done,
            reused_rows=progress.reused_rows,  # answered from output.reuse
            output_tokens=progress.output_tokens,
            generate_seconds=gen,
            output_tokens_per_s=rates.output_tokens_per_s,
            total_tokens_per_s=rates.total_tokens_per_s,
            rows_per_s=round(progress.rows_done / gen, 3) if gen else None,
            updated=progress.updated,
            attempts=progress.attempts,
            failures=progress.failures,
            engine=engine_record(progress.engine),  # which of its task's engines; None: the only one
        )
        if progress.adapter_loads is not None:
            rec["adapter_loads"] = progress.adapter_loads
        task = tasks.get(shard.index)
        # cluster.max_attempts counts per submission: the worker keys failures by Slurm job id
        if task and progress.failures_by_job is not None:
            rec["failures_this_submission"] = progress.failures_in(budget_key(task["job"]))
        # a one-task "array" is a plain job to submitit: Slurm knows it as 123, not 123_0
        job_state = (states.get(task["job"]) or states.get(task["job"].rsplit("_", 1)[0], "")) if task else ""
        rec["job"] = task["job"] if task else None
        rec["job_state"] = job_state or None
        if done:
            state = "done"
        elif job_state in slurm_states.RUNNING:
            state = "running"
        elif job_state in slurm_states.QUEUED or job_state in slurm_states.PAUSED:  # waits, as queued ones do
            state = "pending"
        elif job_state and job_state not in ("COMPLETED",) or progress.last_error:
            state = "failed"
        elif rec["rows_done"]:
            state = "partial"
        else:
            state = "pending"
        rec["state"] = state
        rec["nodes"] = shard_nodes(state, task, nodes)
        if state == "failed":
            log_line = None
            if task and task["folder"]:
                key = f"{task['folder']}/{task['job']}"
                if key not in log_lines:
                    log_lines[key] = last_error_line(Path(task["folder"]), task["job"])
                log_line = log_lines[key]
            rec["error"] = progress.last_error or log_line
            rec["log"] = log_line
        out.append(rec)
    return out


def engine_note(r: ShardState) -> str:
    """`engine 1 of 2 (devices 2,3)`: the worker of a multi-engine task that ran the shard; else nothing."""
    e = r.get("engine")
    if not e or e["of"] < 2:
        return ""
    return f"engine {e['index']} of {e['of']}" + (f" (devices {e['devices']})" if e["devices"] else "")


def running_rates(records: list[ShardState]) -> tuple[float, float, int]:
    """(rows/s, output tok/s, tasks) of the running array tasks together. An engine's shards run one
    at a time, so each engine of a running task (a task runs cluster.engines_per_task of them) counts
    once, at the rate of its most recently updated shard; a task without a rate yet (its engine is
    starting) counts once at the mean rate of the shards that have one."""
    known = [r for r in records if r["rows_per_s"]]
    mean = (
        (sum(r["rows_per_s"] for r in known) / len(known), sum(r["output_tokens_per_s"] for r in known) / len(known))
        if known
        else (0.0, 0.0)
    )
    tasks: dict[Optional[str], list[ShardState]] = {}
    for r in records:
        if r["state"] == "running":
            tasks.setdefault(r["job"], []).append(r)
    rows_s = tokens_s = 0.0
    for shards in tasks.values():
        engines: dict[int, list[ShardState]] = {}
        for r in shards:
            if r["rows_per_s"]:
                engines.setdefault(r["engine"]["index"] if r.get("engine") else 0, []).append(r)
        if not engines:
            rows_s, tokens_s = rows_s + mean[0], tokens_s + mean[1]
        for rated in engines.values():
            r = max(rated, key=lambda r: r["updated"] or 0)
            rows_s, tokens_s = rows_s + r["rows_per_s"], tokens_s + r["output_tokens_per_s"]
    return rows_s, tokens_s, len(tasks)


def summarize(records: list[ShardState]) -> StatusTotals:
    """Totals; output tokens/s of one task while generating (all tokens over all generate seconds) and
    of the running tasks together; ETA = rows left / the running tasks' rows/s."""
    rows = sum(r["rows"] for r in records)
    done = sum(r["rows_done"] for r in records)
    tokens = sum(r["output_tokens"] for r in records)
    gen = sum(r["generate_seconds"] for r in records)
    rows_s, tokens_s, running = running_rates(records)
    eta = (rows - done) / rows_s if rows_s and done < rows else None
    counts: dict[str, int] = {}
    for r in records:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    loads = [r["adapter_loads"] for r in records if "adapter_loads" in r]
    out: StatusTotals = {
        "shards": len(records),
        "states": counts,
        "rows": rows,
        "rows_done": done,
        "reused_rows": sum(r.get("reused_rows", 0) for r in records),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / gen, 1) if gen else None,
        "rows_per_s": round(done / gen, 1) if gen else None,
        "running_tasks": running,
        "running_output_tokens_per_s": round(tokens_s, 1) if running else None,
        "running_rows_per_s": round(rows_s, 3) if running else None,
        "eta_seconds": round(eta) if eta is not None else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if loads:
        out["adapter_loads"] = sum(loads)
    return out


def failures_note(r: ShardState) -> str:
    """`failed 3 times (1 in this submission)`, or nothing for a shard that never failed."""
    if not r.get("failures"):
        return ""
    this = r.get("failures_this_submission")
    times = f"failed {r['failures']} time" + "s" * (r["failures"] != 1)
    return times + (f" ({this} in this submission)" if this is not None else "")


def format_status(
    run: RunDir,
    records: list[ShardState],
    totals: StatusTotals,
    note: Optional[str] = None,
    unrecorded: Optional[dict[str, str]] = None,
) -> str:
    """A plain table for people and Slurm logs; note says Slurm did not answer, unrecorded lists
    jobs found only by the name of a submission that was cut short."""
    pooled = run.recorded_config.task.name in POOLING_TASKS  # nothing generated: rows/s is the rate
    rate = "rows/s" if pooled else "tok/s"
    head = f"{'shard':>5}  {'state':<8} {'rows':>15}  {rate:>8}  {'job':<14} {'attempts':>8}  note"
    lines = [f"{run.path}", head]
    for r in records:
        rows = f"{r['rows_done']} of {r['rows']}"
        value = r["rows_per_s"] if pooled else r["output_tokens_per_s"]
        tps = f"{value:.1f}" if value else "-"
        which = engine_note(r) if r["state"] in ("failed", "partial") else ""
        loads = f"{r['adapter_loads']} adapter loads" if "adapter_loads" in r else ""
        notes = (which, nodes_note(r.get("nodes")), failures_note(r), loads, r.get("error"))
        note_text = "; ".join(x for x in notes if x)
        lines.append(
            f"{r['shard']:>5}  {r['state']:<8} {rows:>15}  {tps:>8}  {r['job'] or '-':<14} {r['attempts']:>8}  {note_text[:100]}"
        )
    states = ", ".join(f"{n} {s}" for s, n in sorted(totals["states"].items()))
    tps, now, eta = totals["output_tokens_per_s"], totals["running_output_tokens_per_s"], totals["eta_seconds"]
    tasks = totals["running_tasks"]
    unit = "engine" if any(r.get("engine") and r["engine"]["of"] > 1 for r in records) else "task"
    if pooled:
        tps, now = totals["rows_per_s"], totals["running_rows_per_s"]
    lines.append(
        f"total: {totals['rows_done']} of {totals['rows']} rows; shards: {states}"
        + (f"; {totals['reused_rows']} rows reused (output.reuse)" if totals.get("reused_rows") else "")
        + (f"; {totals['adapter_loads']} LoRA adapter loads" if "adapter_loads" in totals else "")
        + ("" if pooled else f"; output tokens: {totals['output_tokens']}")
        + (f" ({tps} {rate} per {unit} while {'computing' if pooled else 'generating'})" if tps else "")
        + (f"; now {now} {rate} over {tasks} running task{'s' * (tasks != 1)}" if now else "")
        + (f"; ETA {eta // 3600} h {eta % 3600 // 60} min {eta % 60} s" if eta is not None else "")
    )
    if run.output_path.exists():
        lines.append(f"merged: {run.output_path}")
    if unrecorded:
        shown = ", ".join(f"{j} {s}" for j, s in sorted(unrecorded.items())[:10])
        lines.append(
            f"jobs of a submission cut short, found by job name: {shown} "
            f"(`batchinfer cancel {shlex.quote(str(run.path))}` cancels them)"
        )
    if note:
        lines.append(note)
    return "\n".join(lines)
