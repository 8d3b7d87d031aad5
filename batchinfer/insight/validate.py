"""`batchinfer validate`: every row read, its prompt built and counted as the worker would; no engine."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer.config.schema import check_sampling_column, to_config
from batchinfer.errors import ConfigError
from batchinfer.insight.check_pool import check_parallel
from batchinfer.insight.row_check import check_rows
from batchinfer.insight.sample import Sample, sample_section
from batchinfer.insight.token_stats import token_stats

CHUNK_ROWS = 10_000  # most rows a worker process checks per task: a few seconds, so progress moves
MIN_CHUNK_ROWS = 500  # fewer rows per task and sending tasks and results costs more than checking them
# A worker process takes ~1 s to start (spawn, import datasets, load the tokenizer), the time one
# core checks ~2,700 rows: each gets at least 2 s of rows, or fewer processes finish sooner.
ROWS_PER_WORKER = 5_000
PROGRESS_ROWS = 50_000  # a progress bar from this many rows on (~20 s on one core)


def chunk_size(rows: int, jobs: int) -> int:
    """Rows per task: about 4 tasks per process so that uneven rows even out, within [500, 10,000]."""
    return max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, math.ceil(rows / (4 * jobs))))


OVERLONG = {
    "error_row": "error rows (kind overlong)",
    "truncate_left": "cut from the start, leaving room for max_tokens",
    "truncate_right": "cut at the end, leaving room for max_tokens",
    "fail": "the run stops at the first of them",
}


def overlong_outcome(policy: str, count: int, max_len: int, estimate: Optional[int] = None) -> str:
    """What prompt.overlong does with the rows at or over max_model_len (estimate: of all rows, from a sample)."""
    sampled = "" if estimate is None else "sampled "
    if not count:
        return f"no {sampled}prompt reaches max_model_len={max_len:,}"
    rows = f"{count:,} {sampled}row{'s' if count > 1 else ''}" + (f" (~{estimate:,} of all)" if sampled else "")
    return f"{rows} at or over max_model_len={max_len:,}: {OVERLONG[policy]}"


def validate(
    cfg: DictConfig,
    jobs: Optional[int] = None,
    sample: Optional[int] = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The validate report of a composed config: input, ids, would-be error rows, overlong, token lengths.
    jobs: processes that tokenize (default: the CPUs this process may use; the report is the same
    whatever it is); sample: check only this many rows, spread over the input (Sample)."""
    from batchinfer.inputs.convert import convert_input, open_input
    from batchinfer.inputs.idcheck import id_problems
    from batchinfer.insight.cpus import allowed_cpus
    from batchinfer.launch.local import progress_bar
    from batchinfer.models.maxlen import max_model_len
    from batchinfer.models.tokens import LoginTokenizer, model_dir
    from batchinfer.requests.prompts import check_fields, load_template
    from batchinfer.rundir.prepare import check_writable, resolve_input

    resolved, files = resolve_input(cfg)
    c = to_config(resolved)
    inp, m = c.input, c.model
    check_writable(Path(c.output.dir or "runs"))
    folder = model_dir(m.path, m.revision)
    tok = LoginTokenizer.from_model_dir(folder)
    if c.prompt.mode == "chat" and tok.chat_template is None:
        raise ConfigError(f"model.path {m.path}: the model has no chat template; use prompt.mode=raw")
    max_len, max_len_source = max_model_len(m.max_model_len, folder)
    jobs = jobs or allowed_cpus()
    # Converted as `run` converts it, into a temporary folder ($TMPDIR) removed afterwards.
    with tempfile.TemporaryDirectory(prefix="batchinfer-validate-") as tmp:
        dest = Path(tmp) / "input"
        rows = convert_input(files, inp.format, dest, inp.id_column, inp.columns, strict_ids=False)
        ds = open_input(dest)
        if c.task.name == "score":  # its texts are task.query and task.document, as prepare checks them
            for text in (c.task.query, c.task.document):
                check_fields(text or "", ds.column_names, inp.path)
        else:
            check_fields(load_template(c.prompt), ds.column_names, inp.path)
        check_sampling_column(inp.sampling_column, ds.column_names, inp.path)
        # Ids on every row even in a sample: a duplicate pair is rarely both sampled, and the column is cheap.
        id_count, id_examples = id_problems(ds.data.column(inp.id_column), inp.id_column) if inp.id_column else (0, [])
        todo: Sequence[int] = Sample(rows, sample) if sample and sample < rows else range(rows)
        workers = max(1, min(jobs, len(todo) // ROWS_PER_WORKER))
        bar = progress_bar(len(todo), 0, "validate") if progress and len(todo) >= PROGRESS_ROWS else None
        try:
            if workers > 1:
                size = chunk_size(len(todo), workers)
                found = check_parallel(c, dest, folder, max_len, todo, workers, size, bar and bar.update)
            else:
                found = check_rows(c, ds, tok, max_len, todo, bar and bar.update)
        finally:
            if bar is not None:
                bar.close()
        del ds  # memory-mapped from tmp
    errors, stops, lengths, overlong = found.errors, found.stops, found.lengths, found.overlong
    if id_count:
        stops.kinds["ids"] = {"count": id_count, "examples": [{"message": f"{inp.path}: {e}"} for e in id_examples]}
    policy = c.prompt.overlong
    sampled = sample_section(len(todo), rows, found) if len(todo) < rows else None
    estimate = sampled["estimate"]["overlong_rows"] if sampled else None
    return {
        "input": {"path": inp.path, "format": inp.format, "files": len(files), "rows": rows},
        "model": {"path": m.path, "max_model_len": max_len, "max_model_len_source": max_len_source},
        "prompt": {"mode": c.prompt.mode, "overlong": policy},
        "sample": sampled,
        "stops": {"count": stops.total(), "by_kind": stops.kinds},
        "error_rows": {"count": errors.total(), "by_kind": errors.kinds},
        "overlong": {
            "rows": overlong,
            "policy": policy,
            "outcome": overlong_outcome(policy, overlong, max_len, estimate),
        },
        "prompt_tokens": token_stats(lengths),
        "would_run": len(todo) - errors.total(),
        "exit_code": 2 if stops.total() else 1 if errors.total() else 0,
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as lines for a terminal."""
    inp, mo, pt, sa = r["input"], r["model"], r["prompt_tokens"], r.get("sample")
    est = sa["estimate"] if sa else {}
    files = f", {inp['files']} files" if inp["files"] > 1 else ""
    lines = [
        f"input        {inp['path']} ({inp['format']}{files}): {inp['rows']:,} rows",
        f"model        {mo['path']}",
        f"             max_model_len {mo['max_model_len']:,} ({mo['max_model_len_source']})",
    ]
    if sa:
        lines.append(
            f"sample       sampled {sa['rows']:,} of {sa['of']:,} rows, one in each stretch of "
            f"{sa['of'] / sa['rows']:,.4g}: counts are of the sample, ~ estimates for all rows; ids checked on every row"
        )
    if pt["rows"]:
        all_tokens = f" (~{est['prompt_tokens_total']:,} for all rows)" if sa else ""
        lines.append(
            f"prompt       {r['prompt']['mode']} mode, {pt['rows']:,} rows tokenized: min {pt['min']:,} "
            f"p50 {pt['p50']:,} p90 {pt['p90']:,} p99 {pt['p99']:,} max {pt['max']:,} mean {pt['mean']:,} "
            f"total {pt['total']:,} tokens{all_tokens}"
        )
        peak = max(b["rows"] for b in pt["histogram"])
        for b in pt["histogram"]:
            bar = "#" * max(1 if b["rows"] else 0, round(40 * b["rows"] / peak))
            lines.append(f"  {b['from']:>7,} - {b['to']:<7,} {b['rows']:>9,}  {bar}".rstrip())
    lines.append(f"overlong     {r['overlong']['outcome']} (prompt.overlong={r['overlong']['policy']})")
    for title, section in (("stops run", r["stops"]), ("error rows", r["error_rows"])):
        for kind, entry in section["by_kind"].items():
            scaled = est.get("error_rows_by_kind", {}).get(kind) if section is r["error_rows"] else None
            of_all = "" if scaled is None else f" (~{scaled:,} of all rows)"
            lines.append(f"{title:<12} {kind}: {entry['count']:,}{of_all}")
            for ex in entry["examples"]:
                who = f"id {ex['id']!r}: " if "id" in ex else ""
                lines.append(f"               {who}{ex['message']}")
    verdict = {
        0: f"ok           all {inp['rows']:,} rows would run",
        1: f"rows         {r['would_run']:,} of {inp['rows']:,} rows would run; {r['error_rows']['count']:,} would "
        "become error rows (exit 1)",
        2: "stop         the run would not start or would stop: fix the problems under `stops run` (exit 2)",
    }
    if sa:
        low, high = est["error_rows_95"]
        unchecked = sa["of"] - sa["rows"]
        verdict[0] = f"ok           all {sa['rows']:,} sampled rows would run; {unchecked:,} rows were not checked"
        verdict[1] = (
            f"rows         {r['would_run']:,} of {sa['rows']:,} sampled rows would run; ~{est['error_rows']:,} of "
            f"{inp['rows']:,} rows (95%: {low:,} to {high:,}) would become error rows (exit 1)"
        )
    lines.append(verdict[r["exit_code"]])
    return "\n".join(lines)
