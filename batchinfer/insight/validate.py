"""`batchinfer validate`: every row read, its prompt built and counted as the worker would; no engine."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer.config.schema import POOLING_TASKS, Config, check_sampling_column, to_config
from batchinfer.errors import BatchinferError, ConfigError, InputError

log = logging.getLogger("batchinfer")

EXAMPLES = 5  # examples kept per kind of problem
BATCH_ROWS = 1000  # rows in memory at once
CHUNK_ROWS = 10_000  # most rows a worker process checks per task: a few seconds, so progress moves
MIN_CHUNK_ROWS = 500  # fewer rows per task and sending tasks and results costs more than checking them
# A worker process takes ~1 s to start (spawn, import datasets, load the tokenizer), the time one
# core checks ~2,700 rows: each gets at least 2 s of rows, or fewer processes finish sooner.
ROWS_PER_WORKER = 5_000
PROGRESS_ROWS = 50_000  # a progress bar from this many rows on (~20 s on one core)


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


@dataclass
class Tally:
    """Counts and the first examples of each kind of problem."""

    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, kind: str, example: dict[str, Any]) -> None:
        """Count one problem of a kind, keeping it as an example while there are few."""
        entry = self.kinds.setdefault(kind, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(example)

    def total(self) -> int:
        """Problems of every kind."""
        return sum(e["count"] for e in self.kinds.values())

    def merge(self, later: Tally) -> None:
        """Add the problems of rows that come after these: examples stay the first ones in row order."""
        for kind, theirs in later.kinds.items():
            entry = self.kinds.setdefault(kind, {"count": 0, "examples": []})
            entry["count"] += theirs["count"]
            entry["examples"] = (entry["examples"] + theirs["examples"])[:EXAMPLES]


@dataclass
class Checked:
    """What checking rows found: error rows, run-stopping problems, prompt token lengths, overlong rows."""

    errors: Tally = field(default_factory=Tally)
    stops: Tally = field(default_factory=Tally)
    lengths: Counter[int] = field(default_factory=Counter)
    overlong: int = 0

    def merge(self, later: Checked) -> None:
        """Add what was found in rows that come after these."""
        self.errors.merge(later.errors)
        self.stops.merge(later.stops)
        self.lengths.update(later.lengths)
        self.overlong += later.overlong


def check_rows(
    c: Config,
    ds: Any,
    tok: Any,
    max_len: int,
    rows: Optional[Sequence[int]] = None,
    progress: Optional[Callable[[int], Any]] = None,
) -> Checked:
    """Rows (all by default, in increasing order) as the worker takes them: sampling overrides, prompt,
    tokens, overlong policy; a pooling task's text(s) as PoolingRows builds them."""
    from jinja2.exceptions import TemplateError

    from batchinfer.inputs.openai_batch import task_mismatch
    from batchinfer.requests.build import build_request, row_id
    from batchinfer.requests.prompts import PromptBuilder, RowError

    prompt = c.prompt
    builder = PromptBuilder(prompt)
    found = Checked()
    errors, stops, lengths = found.errors, found.stops, found.lengths
    kwargs = prompt.chat_template_kwargs
    pooled = PooledRows(c, tok, max_len) if c.task.name in POOLING_TASKS else None
    rows = range(len(ds)) if rows is None else rows
    for start in range(0, len(rows), BATCH_ROWS):
        batch = rows[start : start + BATCH_ROWS]
        for index, row in zip(batch, ds.select(batch).to_list(), strict=True):
            example = {"row": index, "id": row_id(c, row, index)}
            try:
                if pooled is not None:
                    why = task_mismatch(row, c.task.name)
                    if why:  # PoolingRows' error row for an OpenAI request of another task
                        errors.add("unsupported", dict(example, message=f"row {index}: {why}"))
                        continue
                    try:
                        pooled.check(builder, row, index)
                    finally:  # counted like a generation prompt: an overlong error row too
                        if pooled.raw:
                            lengths[sum(pooled.raw)] += 1
                            found.overlong += any(n > max_len for n in pooled.raw)
                    continue
                req = build_request(c, builder, row, index, lambda p: tok.encode(p, kwargs))
                lengths[len(req.ids)] += 1
                found.overlong += len(req.ids) >= max_len
                req.fit(prompt.overlong, max_len)
            except RowError as e:
                errors.add(e.kind, dict(example, message=f"row {index}: {e.message}"))
            except TemplateError as e:  # the engine's chat template raises the same: the shard would fail
                stops.add("chat_template", dict(example, message=f"row {index}: chat template: {e}"))
            except InputError as e:  # prompt.overlong=fail stops the run
                stops.add("overlong", dict(example, message=f"row {index}: {e}"))
        if progress is not None:
            progress(len(batch))
    return found


class PooledRows:
    """A pooling task's rows as the worker builds them (requests/pooling.py), tokenized on the login
    node: a cross-encoder's score pair as one input, cut as the engine's tokenizer cuts it."""

    def __init__(self, c: Config, tok: Any, max_len: int) -> None:
        from batchinfer.models.pooling import is_cross_encoder
        from batchinfer.models.tokens import model_dir
        from batchinfer.requests.pooling import special_tokens

        self.c, self.tok, self.max_len = c, tok, max_len
        self.kwargs = c.prompt.chat_template_kwargs
        self.raw: list[int] = []  # the last row's texts' token counts (one, two, or a pair's)
        self.around = special_tokens(lambda text: tok.encode(text))
        # vLLM's rule (engine/pooled.py): a classifier scores the pair as one input, an embedder as two
        self.cross = c.task.name == "score" and is_cross_encoder(model_dir(c.model.path or "", c.model.revision))

    def encode_pair(self, query: str, document: str, limit: Optional[int]) -> tuple[list[int], int]:
        """The pair as one input and where the document starts; with limit, the document cut to fit."""
        from batchinfer.requests.prompts import RowError

        t = self.tok.tokenizer
        if limit:
            t.enable_truncation(limit, strategy="only_second")
        try:
            enc = t.encode(query, document)
        except Exception as e:  # the query alone is longer than the limit
            raise RowError("overlong", f"the pair cannot be cut to {limit} tokens: {e}") from None
        finally:
            if limit:
                t.no_truncation()
        return list(enc.ids), enc.type_ids.index(1) if 1 in enc.type_ids else len(enc.ids)

    def check(self, builder: Any, row: dict[str, Any], index: int) -> None:
        """Build the row's request as the worker does: RowError / InputError as it raises them. Its
        texts' token counts before the overlong policy are left in self.raw."""
        from batchinfer.requests.pooling import pooling_request

        self.raw = raw = []

        def encode(prompt: Any) -> list[int]:
            ids = self.tok.encode(prompt, self.kwargs)
            raw.append(len(ids))
            return ids

        def encode_pair(query: str, document: str, limit: Optional[int]) -> tuple[list[int], int]:
            ids, boundary = self.encode_pair(query, document, limit)
            if limit is None:
                raw.append(len(ids))
            return ids, boundary

        pair = encode_pair if self.cross else None
        pooling_request(self.c, builder, row, index, encode, self.max_len, self.around, pair)


# One worker process's own tokenizer and memory-mapped dataset, loaded once by _start_worker.
_WORKER: dict[str, Any] = {}


def _start_worker(c: Config, dest: str, folder: str, max_len: int) -> None:
    import signal

    from batchinfer.inputs.read import open_input
    from batchinfer.models.tokens import LoginTokenizer

    # Ctrl-C reaches the whole process group: the parent stops the pool, workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # die with the parent (killed validate), rather than linger holding the dataset's memory map
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    _WORKER.update(c=c, ds=open_input(Path(dest)), tok=LoginTokenizer.from_model_dir(folder), max_len=max_len)


def _check_chunk(rows: Sequence[int]) -> tuple[int, Checked]:
    w = _WORKER
    return os.getpid(), check_rows(w["c"], w["ds"], w["tok"], w["max_len"], rows)


def chunk_size(rows: int, jobs: int) -> int:
    """Rows per task: about 4 tasks per process so that uneven rows even out, within [500, 10,000]."""
    return max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, math.ceil(rows / (4 * jobs))))


def check_parallel(
    c: Config,
    dest: Path,
    folder: Path,
    max_len: int,
    rows: Sequence[int],
    jobs: int,
    chunk_rows: int,
    progress: Optional[Callable[[int], Any]] = None,
) -> Checked:
    """check_rows over chunks of rows in `jobs` worker processes, merged in row order: the same result
    as one process. Spawned, not forked: the parent already runs pyarrow's and the tokenizer's threads,
    and a fork copies their locks in whatever state they are (deadlocks; tokenizers then turns its
    parallelism off with a warning); spawn costs each worker ~1 s of imports, once per run. A script
    calling this needs the `if __name__ == "__main__":` guard: spawn imports the main module."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    chunks = [rows[i : i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    merged, pending, nxt, pids = Checked(), {}, 0, set()
    ctx = multiprocessing.get_context("spawn")
    init = (c, str(dest), str(folder), max_len)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_start_worker, initargs=init) as pool:
        try:
            futures = {pool.submit(_check_chunk, chunk): k for k, chunk in enumerate(chunks)}
            for future in as_completed(futures):
                try:
                    pid, pending[futures[future]] = future.result()
                except BrokenProcessPool:
                    raise BatchinferError(
                        f"validate: a worker process died (out of memory?); try fewer processes than --jobs {jobs}"
                    ) from None
                pids.add(pid)
                while nxt in pending:  # merged in row order as soon as the earlier chunks are in
                    merged.merge(pending.pop(nxt))
                    nxt += 1
                if progress is not None:
                    progress(len(chunks[futures[future]]))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # workers finish their chunk (seconds), start no other
            raise
    log.debug("validate: %d chunks of %d rows checked by worker processes %s", len(chunks), chunk_rows, sorted(pids))
    return merged


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    # splitmix64: a well-spread 64-bit hash of x, so that row k of a sample needs no generator state.
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Sample(Sequence[int]):
    """n rows of total, one in each of n equal stretches, at a place in it the seed picks: spread over
    the whole corpus like evenly spaced rows, but a corpus that repeats with a period (sources
    interleaved, a header every k rows) cannot line up with the spacing. The same rows every time.
    Rows are computed when asked, so a sample of millions is no list of millions (a slice is a list)."""

    def __init__(self, total: int, n: int, seed: int = 0) -> None:
        self.total, self.n, self.seed = total, min(n, total), seed

    def __len__(self) -> int:
        return self.n

    def _row(self, k: int) -> int:
        lo, hi = k * self.total // self.n, (k + 1) * self.total // self.n
        return lo + _mix(self.seed * self.total + k) % (hi - lo)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self._row(i % self.n)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion seen hits times in n draws (sound at 0 and n, unlike p +- 2 sd)."""
    p, z2 = hits / n, z * z
    centre, half = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))


def sample_section(checked: int, total: int, found: Checked) -> dict[str, Any]:
    """What a sample says of the whole corpus: counts scaled by total/checked, error rows with a 95% range."""
    scale, errors = total / checked, found.errors.total()
    lo, hi = wilson(errors, checked)
    # The sample's own rows are known: at least its error rows, at most every row outside its good ones.
    low, high = max(errors, math.floor(lo * total)), min(total - (checked - errors), math.ceil(hi * total))
    estimate = {
        "error_rows": round(errors * scale),
        "error_rows_95": [low, high],
        "error_rows_by_kind": {k: round(e["count"] * scale) for k, e in found.errors.kinds.items()},
        "overlong_rows": round(found.overlong * scale),
        "prompt_tokens_total": round(sum(v * n for v, n in found.lengths.items()) * scale),
    }
    estimate["would_run"] = total - estimate["error_rows"]
    return {
        "rows": checked,
        "of": total,
        "spread": "one row in each of `rows` equal stretches, picked by seed 0",
        "estimate": estimate,
    }


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
    from batchinfer.inputs.read import convert_input, id_problems, open_input
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
