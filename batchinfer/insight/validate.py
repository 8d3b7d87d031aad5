"""`batchinfer validate`: every row read, its prompt built and counted as the worker would; no engine."""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from batchinfer.config.schema import Config, to_config
from batchinfer.errors import ConfigError, InputError

EXAMPLES = 5  # examples kept per kind of problem
BATCH_ROWS = 1000  # rows in memory at once


def percentile(counts: Counter[int], q: float) -> int:
    """Nearest-rank percentile of values given as value -> how many times."""
    rank, seen = max(1, math.ceil(q * sum(counts.values()))), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise ValueError("no values")


def histogram(counts: Counter[int], bins: int = 10) -> list[dict[str, int]]:
    """Rows per equal-width bin of token lengths up to p99, [from, to] inclusive; the rare longer
    prompts share one last bin, so that one outlier does not squeeze every other row into one bar."""
    lo, hi, top = min(counts), percentile(counts, 0.99), max(counts)
    width = max(1, math.ceil((hi - lo + 1) / (bins - 1 if top > hi else bins)))
    out = [{"from": a, "to": min(a + width - 1, hi), "rows": 0} for a in range(lo, hi + 1, width)]
    if top > hi:
        out.append({"from": hi + 1, "to": top, "rows": 0})
    for value, n in counts.items():
        out[len(out) - 1 if value > hi else (value - lo) // width]["rows"] += n
    return out


def token_stats(counts: Counter[int]) -> dict[str, Any]:
    """min, p50, p90, p99, max, mean, total and a histogram of prompt token lengths."""
    if not counts:
        return {"rows": 0}
    rows = sum(counts.values())
    total = sum(v * n for v, n in counts.items())
    stats: dict[str, Any] = {"rows": rows, "min": min(counts)}
    stats |= {f"p{round(q * 100)}": percentile(counts, q) for q in (0.5, 0.9, 0.99)}
    return stats | {"max": max(counts), "mean": round(total / rows, 1), "total": total, "histogram": histogram(counts)}


class Tally:
    """Counts and the first examples of each kind of problem."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, Any]] = {}

    def add(self, kind: str, example: dict[str, Any]) -> None:
        """Count one problem of a kind, keeping it as an example while there are few."""
        entry = self.kinds.setdefault(kind, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(example)

    def total(self) -> int:
        """Problems of every kind."""
        return sum(e["count"] for e in self.kinds.values())


def check_rows(c: Config, ds: Any, tok: Any, max_len: int) -> tuple[Tally, Tally, Counter[int], int]:
    """Every row as the worker takes it: sampling overrides, prompt, tokens, overlong policy.
    Returns error rows, run-stopping problems, prompt token lengths and rows at or over max_model_len."""
    from jinja2.exceptions import TemplateError

    from batchinfer.requests.build import build_request, overlong_tokens, row_id
    from batchinfer.requests.prompts import PromptBuilder, RowError

    prompt = c.prompt
    builder = PromptBuilder(prompt)
    errors, stops, lengths, overlong = Tally(), Tally(), Counter[int](), 0
    kwargs = prompt.chat_template_kwargs
    for start in range(0, len(ds), BATCH_ROWS):
        rows = ds.select(range(start, min(start + BATCH_ROWS, len(ds)))).to_list()
        for index, row in enumerate(rows, start=start):
            example = {"row": index, "id": row_id(c, row, index)}
            try:
                req = build_request(c, builder, row, index, lambda p: tok.encode(p, kwargs))
                lengths[len(req.ids)] += 1
                overlong += len(req.ids) >= max_len
                overlong_tokens(req.ids, prompt.overlong, max_len, req.sampling["max_tokens"])
            except RowError as e:
                errors.add(e.kind, dict(example, message=f"row {index}: {e.message}"))
            except TemplateError as e:  # the engine's chat template raises the same: the shard would fail
                stops.add("chat_template", dict(example, message=f"row {index}: chat template: {e}"))
            except InputError as e:  # prompt.overlong=fail stops the run
                stops.add("overlong", dict(example, message=f"row {index}: {e}"))
    return errors, stops, lengths, overlong


OVERLONG = {
    "error_row": "error rows (kind overlong)",
    "truncate_left": "cut from the start, leaving room for max_tokens",
    "truncate_right": "cut at the end, leaving room for max_tokens",
    "fail": "the run stops at the first of them",
}


def overlong_outcome(policy: str, count: int, max_len: int) -> str:
    """What prompt.overlong does with the rows at or over max_model_len."""
    if not count:
        return f"no prompt reaches max_model_len={max_len:,}"
    return f"{count:,} row{'s' if count > 1 else ''} at or over max_model_len={max_len:,}: {OVERLONG[policy]}"


def validate(cfg: DictConfig) -> dict[str, Any]:
    """The validate report of a composed config: input, ids, would-be error rows, overlong, token lengths."""
    from batchinfer.inputs.read import convert_input, id_problems, open_input
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
    # Converted as `run` converts it, into a temporary folder ($TMPDIR) removed afterwards.
    with tempfile.TemporaryDirectory(prefix="batchinfer-validate-") as tmp:
        dest = Path(tmp) / "input"
        rows = convert_input(files, inp.format, dest, inp.id_column, inp.columns, strict_ids=False)
        ds = open_input(dest)
        check_fields(load_template(c.prompt), ds.column_names, inp.path)
        id_count, id_examples = id_problems(ds.data.column(inp.id_column), inp.id_column) if inp.id_column else (0, [])
        errors, stops, lengths, overlong = check_rows(c, ds, tok, max_len)
        del ds  # memory-mapped from tmp
    if id_count:
        stops.kinds["ids"] = {"count": id_count, "examples": [{"message": f"{inp.path}: {e}"} for e in id_examples]}
    policy = c.prompt.overlong
    return {
        "input": {"path": inp.path, "format": inp.format, "files": len(files), "rows": rows},
        "model": {"path": m.path, "max_model_len": max_len, "max_model_len_source": max_len_source},
        "prompt": {"mode": c.prompt.mode, "overlong": policy},
        "stops": {"count": stops.total(), "by_kind": stops.kinds},
        "error_rows": {"count": errors.total(), "by_kind": errors.kinds},
        "overlong": {"rows": overlong, "policy": policy, "outcome": overlong_outcome(policy, overlong, max_len)},
        "prompt_tokens": token_stats(lengths),
        "would_run": rows - errors.total(),
        "exit_code": 2 if stops.total() else 1 if errors.total() else 0,
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as lines for a terminal."""
    inp, mo, pt = r["input"], r["model"], r["prompt_tokens"]
    files = f", {inp['files']} files" if inp["files"] > 1 else ""
    lines = [
        f"input        {inp['path']} ({inp['format']}{files}): {inp['rows']:,} rows",
        f"model        {mo['path']}",
        f"             max_model_len {mo['max_model_len']:,} ({mo['max_model_len_source']})",
    ]
    if pt["rows"]:
        lines.append(
            f"prompt       {r['prompt']['mode']} mode, {pt['rows']:,} rows tokenized: min {pt['min']:,} "
            f"p50 {pt['p50']:,} p90 {pt['p90']:,} p99 {pt['p99']:,} max {pt['max']:,} mean {pt['mean']:,} "
            f"total {pt['total']:,} tokens"
        )
        peak = max(b["rows"] for b in pt["histogram"])
        for b in pt["histogram"]:
            bar = "#" * max(1 if b["rows"] else 0, round(40 * b["rows"] / peak))
            lines.append(f"  {b['from']:>7,} - {b['to']:<7,} {b['rows']:>9,}  {bar}".rstrip())
    lines.append(f"overlong     {r['overlong']['outcome']} (prompt.overlong={r['overlong']['policy']})")
    for title, section in (("stops run", r["stops"]), ("error rows", r["error_rows"])):
        for kind, entry in section["by_kind"].items():
            lines.append(f"{title:<12} {kind}: {entry['count']:,}")
            for ex in entry["examples"]:
                who = f"id {ex['id']!r}: " if "id" in ex else ""
                lines.append(f"               {who}{ex['message']}")
    verdict = {
        0: f"ok           all {inp['rows']:,} rows would run",
        1: f"rows         {r['would_run']:,} of {inp['rows']:,} rows would run; {r['error_rows']['count']:,} would "
        "become error rows (exit 1)",
        2: "stop         the run would not start or would stop: fix the problems under `stops run` (exit 2)",
    }
    lines.append(verdict[r["exit_code"]])
    return "\n".join(lines)
