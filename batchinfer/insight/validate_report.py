"""The validate report: what checking a corpus found, as a dict (`--json`) and as lines for a terminal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, TypedDict

from batchinfer.config.schema import Config
from batchinfer.insight.findings import Checked, KindCount
from batchinfer.insight.sample import SampleSection, sample_section
from batchinfer.insight.token_stats import TokenStats, token_stats


@dataclass
class Validated:
    """What validate learned of a run's config and input, for the report."""

    c: Config
    files: int  # input files
    rows: int  # rows in the input
    max_len: int
    max_len_source: str
    checked: int  # rows checked: all, or a sample's
    found: Checked  # ids problems already among found.stops
    notes: list[str] = field(default_factory=list)  # what the run does that the config does not say
    adapters: Optional[dict[str, int]] = None  # rows per LoRA adapter name (None: no adapters)


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


def exit_code(found: Checked) -> int:
    """2 when the run would not start or would stop, 1 when some rows would become error rows, else 0."""
    return 2 if found.stops.total() else 1 if found.errors.total() else 0


class Problems(TypedDict):
    """Rows that stop the run, or would become error rows: how many, and by kind."""

    count: int
    by_kind: dict[str, KindCount]


class InputSummary(TypedDict):
    """The input validate read."""

    path: Optional[str]
    format: Optional[str]
    files: int
    rows: int


class ModelSummary(TypedDict):
    """The model's context length and where it comes from."""

    path: Optional[str]
    max_model_len: int
    max_model_len_source: str


class OverlongSummary(TypedDict):
    """Rows at or over max_model_len, and what prompt.overlong makes of them."""

    rows: int
    policy: str
    outcome: str


class ValidateReport(TypedDict):
    """`validate --json`: input, model, prompt, notes, sample, problems, overlong rows, token lengths."""

    input: InputSummary
    model: ModelSummary
    prompt: dict[str, str]  # mode, overlong
    notes: list[str]
    sample: Optional[SampleSection]  # None: every row checked
    stops: Problems
    error_rows: Problems
    overlong: OverlongSummary
    prompt_tokens: TokenStats
    would_run: int
    exit_code: int


def build_report(v: Validated) -> ValidateReport:
    """The validate report: input, ids, would-be error rows, overlong, token lengths, exit code."""
    inp, m, found = v.c.input, v.c.model, v.found
    errors, stops, policy = found.errors, found.stops, v.c.prompt.overlong
    sampled = sample_section(v.checked, v.rows, found) if v.checked < v.rows else None
    estimate = sampled["estimate"]["overlong_rows"] if sampled else None
    return {
        "input": {"path": inp.path, "format": inp.format, "files": v.files, "rows": v.rows},
        "model": {"path": m.path, "max_model_len": v.max_len, "max_model_len_source": v.max_len_source},
        "prompt": {"mode": v.c.prompt.mode, "overlong": policy},
        "notes": v.notes,
        "adapters": v.adapters,
        "sample": sampled,
        "stops": {"count": stops.total(), "by_kind": stops.kinds},
        "error_rows": {"count": errors.total(), "by_kind": errors.kinds},
        "overlong": {
            "rows": found.overlong,
            "policy": policy,
            "outcome": overlong_outcome(policy, found.overlong, v.max_len, estimate),
        },
        "prompt_tokens": token_stats(found.lengths),
        "would_run": v.checked - errors.total(),
        "exit_code": exit_code(found),
    }


def format_report(r: ValidateReport) -> str:
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
    if r.get("adapters"):
        lines.append("adapters     " + ", ".join(f"{name} {n:,} rows" for name, n in r["adapters"].items()))
    lines += [f"note         {note}" for note in r.get("notes") or []]
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
