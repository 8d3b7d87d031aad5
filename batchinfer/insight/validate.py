"""`batchinfer validate`: every row read, its prompt built and counted as the worker would; no engine.
The steps: the model's tokenizer and window, the input converted as `run` converts it, its columns
checked, its rows checked (in worker processes when there are many), the report."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer.config.checks import check_sampling_column
from batchinfer.config.schema import Config, to_config
from batchinfer.errors import ConfigError
from batchinfer.insight.check_pool import check_parallel
from batchinfer.insight.findings import Checked
from batchinfer.insight.row_check import check_rows
from batchinfer.insight.sample import Sample
from batchinfer.insight.validate_report import Validated, ValidateReport, build_report

CHUNK_ROWS = 10_000  # most rows a worker process checks per task: a few seconds, so progress moves
MIN_CHUNK_ROWS = 500  # fewer rows per task and sending tasks and results costs more than checking them
# A worker process takes ~1 s to start (spawn, import datasets, load the tokenizer), the time one
# core checks ~2,700 rows: each gets at least 2 s of rows, or fewer processes finish sooner.
ROWS_PER_WORKER = 5_000
PROGRESS_ROWS = 50_000  # a progress bar from this many rows on (~20 s on one core)


def chunk_size(rows: int, jobs: int) -> int:
    """Rows per task: about 4 tasks per process so that uneven rows even out, within [500, 10,000]."""
    return max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, math.ceil(rows / (4 * jobs))))


def _check_columns(c: Config, ds: Any) -> Checked:
    """The templates' fields and the sampling column must be input columns (else ConfigError); ids are
    checked on every row even in a sample: a duplicate pair is rarely both sampled, and the column is
    cheap. A Checked holding the ids problems, if any."""
    from batchinfer.inputs.idcheck import id_problems
    from batchinfer.requests.row_templates import check_row_templates

    inp = c.input
    check_row_templates(c, ds.column_names, inp.path)
    check_sampling_column(inp.sampling_column, ds.column_names, inp.path)
    ids = Checked()
    id_count, id_examples = id_problems(ds.data.column(inp.id_column), inp.id_column) if inp.id_column else (0, [])
    if id_count:
        ids.stops.kinds["ids"] = {"count": id_count, "examples": [{"message": f"{inp.path}: {e}"} for e in id_examples]}
    return ids


def image_note(c: Config, columns: list[str]) -> Optional[str]:
    """How validate counted the rows' images' tokens (models/image_tokens.py), where rows have images."""
    from batchinfer.inputs.openai_batch import IMAGE_URL
    from batchinfer.models.image_tokens import model_image_tokens

    if not c.prompt.image_column and IMAGE_URL not in columns:
        return None
    return model_image_tokens(c.model.path, c.model.revision).note()


def adapter_counts(c: Config, ds: Any) -> Optional[dict[str, int]]:
    """Rows per LoRA adapter the rows name (all rows, even in a sample; null: model.lora.default,
    else the base model; a name model.lora.adapters lacks is counted too, its rows are error rows);
    None without adapters."""
    from collections import Counter

    from batchinfer.insight.adapters import BASE

    lora = c.model.lora
    if not lora.adapters:
        return None
    default = lora.default or BASE
    column = c.input.adapter_column
    if not column or column not in ds.column_names:
        return {default: ds.num_rows}
    counts = Counter(default if v is None else str(v) for v in ds.data.column(column).to_pylist())
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != BASE, kv[0])))


def _check_all(
    c: Config, ds: Any, dest: Path, folder: Path, tok: Any, max_len: int, todo: Sequence[int], jobs: int, progress: bool
) -> Checked:
    """The rows of todo checked, in worker processes when each gets enough of them, with a progress bar
    when they are many."""
    from batchinfer.launch.shardloop import progress_bar

    workers = max(1, min(jobs, len(todo) // ROWS_PER_WORKER))
    bar = progress_bar(len(todo), 0, "validate") if progress and len(todo) >= PROGRESS_ROWS else None
    update: Optional[Callable[[int], Any]] = bar and bar.update
    try:
        if workers > 1:
            return check_parallel(c, dest, folder, max_len, todo, workers, chunk_size(len(todo), workers), update)
        return check_rows(c, ds, tok, max_len, todo, update)
    finally:
        if bar is not None:
            bar.close()


def validate(
    cfg: DictConfig,
    jobs: Optional[int] = None,
    sample: Optional[int] = None,
    progress: bool = True,
) -> ValidateReport:
    """The validate report of a composed config: input, ids, would-be error rows, overlong, token lengths.
    jobs: processes that tokenize (default: the CPUs this process may use; the report is the same
    whatever it is); sample: check only this many rows, spread over the input (Sample)."""
    from batchinfer.inputs.convert import convert_input, open_input
    from batchinfer.insight.cpus import allowed_cpus
    from batchinfer.models.maxlen import max_model_len
    from batchinfer.models.tokens import LoginTokenizer, model_dir
    from batchinfer.requests.prompts import messages_note
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
        ids = _check_columns(c, ds)
        todo: Sequence[int] = Sample(rows, sample) if sample and sample < rows else range(rows)
        found = _check_all(c, ds, dest, folder, tok, max_len, todo, jobs or allowed_cpus(), progress)
        notes = [n for n in [messages_note(c.prompt, ds.data), image_note(c, ds.column_names)] if n]
        adapters = adapter_counts(c, ds)
        del ds  # memory-mapped from tmp
    found.stops.kinds |= ids.stops.kinds  # after the rows' own stops, as the report lists them
    return build_report(Validated(c, len(files), rows, max_len, max_len_source, len(todo), found, notes, adapters))
