"""`status`: per-shard state from the run directory plus squeue/sacct, totals, tokens/s, ETA."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from batchinfer.store import RunDir, read_json

RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING"}
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESIZING"}


def submissions(run: RunDir) -> list[dict[str, Any]]:
    """Records of DIR/jobs.jsonl, oldest first."""
    path = run.path / "jobs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shard_tasks(run: RunDir) -> dict[int, dict[str, Any]]:
    """The latest array task each shard was given to: job id, log folder, submission."""
    out: dict[int, dict[str, Any]] = {}
    for sub in submissions(run):
        for array in sub["arrays"]:
            for index, shards in array["tasks"].items():
                for shard in shards:
                    out[shard] = {
                        "job": f"{array['job_id']}_{index}",
                        "folder": sub["folder"],
                        "submission": sub["submission"],
                    }
    return out


def all_job_ids(run: RunDir) -> list[str]:
    """Every array and merge job recorded for DIR."""
    ids = []
    for sub in submissions(run):
        ids += [a["job_id"] for a in sub["arrays"]]
        if sub.get("merge"):
            ids.append(sub["merge"])
    return ids


def last_error_line(folder: Path, job: str) -> Optional[str]:
    """The last line of a task's stderr log that looks like an error."""
    logs = sorted(folder.glob(f"{job}_*log.err")) if folder.is_dir() else []
    lines = [ln.strip() for p in logs for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "Killed" in ln or "CANCELLED" in ln]
    return (errors or lines or [None])[-1]


def shard_status(run: RunDir, states: dict[str, str]) -> list[dict[str, Any]]:
    """One record per shard: state, rows done of total, tokens, attempts, last error."""
    tasks = shard_tasks(run)
    out = []
    for shard in run.shards():
        rec: dict[str, Any] = {"shard": shard.index, "rows": shard.rows, "rows_done": 0, "output_tokens": 0}
        progress_path = run.done_path(shard.index) if run.is_done(shard.index) else run.progress_path(shard.index)
        progress = read_json(progress_path) if progress_path.is_file() else {}
        rec.update(
            rows_done=progress.get("rows_done", 0),
            output_tokens=progress.get("output_tokens", 0),
            generate_seconds=progress.get("seconds", {}).get("generate", 0.0),
            attempts=progress.get("attempts", 0),
        )
        task = tasks.get(shard.index)
        job_state = states.get(task["job"], "") if task else ""
        rec["job"] = task["job"] if task else None
        rec["job_state"] = job_state or None
        if run.is_done(shard.index):
            state = "done"
        elif job_state in RUNNING:
            state = "running"
        elif job_state in QUEUED:
            state = "pending"
        elif job_state and job_state not in ("COMPLETED",) or progress.get("last_error"):
            state = "failed"
        elif rec["rows_done"]:
            state = "partial"
        else:
            state = "pending"
        rec["state"] = state
        if state == "failed":
            log_line = last_error_line(Path(task["folder"]), task["job"]) if task else None
            rec["error"] = progress.get("last_error") or log_line
            rec["log"] = log_line
        out.append(rec)
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals, output tokens/s over generation time, and an ETA from the running shards' rate."""
    rows = sum(r["rows"] for r in records)
    done = sum(r["rows_done"] for r in records)
    tokens = sum(r["output_tokens"] for r in records)
    gen = sum(r["generate_seconds"] for r in records)
    rate_rows = done / gen if gen else 0.0
    running = sum(1 for r in records if r["state"] == "running")
    eta = (rows - done) / (rate_rows * running) if rate_rows and running and done < rows else None
    counts: dict[str, int] = {}
    for r in records:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    return {
        "shards": len(records),
        "states": counts,
        "rows": rows,
        "rows_done": done,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / gen, 1) if gen else None,
        "eta_seconds": round(eta) if eta is not None else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def format_status(run: RunDir, records: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    """A plain table for people and Slurm logs."""
    lines = [f"{run.path}", f"{'shard':>5}  {'state':<8} {'rows':>15}  {'job':<14} {'attempts':>8}  note"]
    for r in records:
        rows = f"{r['rows_done']} of {r['rows']}"
        note = r.get("error") or ""
        lines.append(
            f"{r['shard']:>5}  {r['state']:<8} {rows:>15}  {r['job'] or '-':<14} {r['attempts']:>8}  {note[:100]}"
        )
    states = ", ".join(f"{n} {s}" for s, n in sorted(totals["states"].items()))
    tps = totals["output_tokens_per_s"]
    eta = totals["eta_seconds"]
    lines.append(
        f"total: {totals['rows_done']} of {totals['rows']} rows; shards: {states}; "
        f"output tokens: {totals['output_tokens']}"
        + (f" ({tps} tok/s while generating)" if tps else "")
        + (f"; ETA {eta // 60} min {eta % 60} s" if eta is not None else "")
    )
    if run.output_path.exists():
        lines.append(f"merged: {run.output_path}")
    return "\n".join(lines)
