"""What `status` and `report` say about a run directory's passes (`batchinfer redo`): per pass its
command, rows and state, the unfinished pass's shards, and rows of the output per pass."""

from __future__ import annotations

from typing import NotRequired, Optional, TypedDict

from batchinfer.insight.status import ShardState, StatusTotals
from batchinfer.ownership import Kind
from batchinfer.rundir import passes
from batchinfer.rundir.store import RunDir

# One pass in `status` (`status --json`'s `passes`); the unfinished pass with its shards and totals.
PassStatus = TypedDict(
    "PassStatus",
    {
        "pass": int,
        "dir": str,
        "where": str,
        "overrides": list[str],
        "rows": int,
        "shards": int,
        "shards_done": int,
        "state": str,  # being made, half made, unfinished, finished or merged
        "sampling_overridden": list[str],
        "strays": list[str],  # a half-made pass's names a redo never makes (ownership: refused until moved)
        "shard_states": NotRequired[list[ShardState]],
        "totals": NotRequired[StatusTotals],
    },
)


def pass_records(root: RunDir) -> list[PassStatus]:
    """One record per pass: number, where, overrides, rows, shards done, state."""
    merged = passes.merged_passes(root) or []
    out = []
    for number in passes.pass_numbers(root):
        path = passes.pass_path(root, number)
        rec = passes.read_record(path)
        run = RunDir(path)
        found = passes.recognise(path)
        kind = found.kind
        shards = run.shards() if run.exists() and kind is Kind.DONE else []
        done = sum(run.shard_folder(s.index).is_done() for s in shards)
        if kind is not Kind.DONE:
            state = _making(kind)
        elif done < len(shards):
            state = "unfinished"
        else:
            state = "merged" if number in merged else "finished"
        out.append(
            {
                "pass": number,
                "dir": str(path),
                "where": rec.where,
                "overrides": rec.overrides,
                "rows": rec.rows,
                "shards": len(shards),
                "shards_done": done,
                "state": state,
                "sampling_overridden": list(run.recorded_config.input.sampling_overridden) if run.exists() else [],
                "strays": list(found.strays),
            }
        )
    return out


def _making(kind: Kind) -> str:
    """The state of a pass not made yet: a live redo makes it, or a stopped one left it half made."""
    return "half made" if kind is Kind.HALF_MADE else "being made"


def pass_lines(root: RunDir, records: list[PassStatus]) -> list[str]:
    """status's lines about passes; the unfinished pass's own table follows them (status_of)."""
    lines = []
    for r in records:
        what = " ".join([f"--where {r['where']!r}", *r["overrides"]])
        lines.append(
            f"pass {r['pass']}: {r['state']}, {r['rows']} rows, {r['shards_done']} of {r['shards']} shards done ({what})"
        )
        if r.get("sampling_overridden"):
            keys = ", ".join(f"sampling.{k}" for k in r["sampling_overridden"])
            lines.append(f"  its {keys} wins over the rows' own values (input.sampling_column or the request's body)")
        if r["state"] == "half made" and r.get("strays"):
            lines.append(
                f"  its redo was stopped while making it, and it holds {', '.join(r['strays'])}, which a redo never "
                f"makes: move them out of {r['dir']}, then the next redo takes it over and makes it again"
            )
        elif r["state"] == "half made":
            lines.append("  its redo was stopped while making it: the next redo takes it over and makes it again")
    return lines


def unfinished_run(root: RunDir) -> Optional[RunDir]:
    """The unfinished pass's run directory, when it has one (its shards are what status shows)."""
    number = passes.unfinished_pass(root)
    if number is None or not RunDir(passes.pass_path(root, number)).exists():
        return None
    return RunDir(passes.pass_path(root, number))


def rows_per_pass(root: RunDir) -> Optional[dict[str, int]]:
    """Rows of DIR's merged output per pass (stats.json; None before any pass was merged)."""
    stats = root.stats()
    return stats.get("passes") if stats is not None else None


def report_lines(counts: Optional[dict[str, int]]) -> list[str]:
    """report.md's line on passes."""
    if not counts:
        return []
    shown = ", ".join(f"pass {k}: {v:,}" for k, v in counts.items())
    return [f"rows of the output per pass (0: the run itself; `batchinfer redo`): {shown}", ""]


def status_section(root: RunDir) -> tuple[list[PassStatus], str]:
    """status's records and text about DIR's passes, with the unfinished pass's shard table."""
    from batchinfer.insight.status import format_status, shard_status, summarize
    from batchinfer.launch.jobs import slurm_states

    records = pass_records(root)
    if not records:
        return [], ""
    lines = pass_lines(root, records)
    run = unfinished_run(root)
    if run is not None:
        states, unrecorded, note = slurm_states(run)
        shards = shard_status(run, states)
        totals = summarize(shards)
        next(r for r in records if r["pass"] == int(run.path.name)).update(shard_states=shards, totals=totals)
        lines.append(format_status(run, shards, totals, note=note, unrecorded=unrecorded))
    return records, "\n".join(lines)
