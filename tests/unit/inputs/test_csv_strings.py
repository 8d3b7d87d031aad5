"""CSV and TSV cells are read as the strings they are (issue 26): `007` and `7` stay two ids,
`0012` and `1e3` stay text, and NA, null, N/A, nan are words, not nulls; plan's peek agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.inputs.convert import open_input
from batchinfer.inputs.preview import _table
from batchinfer.rundir.prepare import prepare

ROWS = [("007", "NA", "1e3"), ("7", "null", "0012"), ("8", "N/A", "nan"), ("9", 'a, "quoted" text', "")]


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_cells_are_strings_and_words_are_not_nulls(tmp_path: Path, fmt: str) -> None:
    import csv

    path = tmp_path / f"c.{fmt}"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="," if fmt == "csv" else "\t")
        w.writerow(["id", "text", "n"])
        w.writerows(ROWS)
    ov = [
        f"input.path={path}",
        "input.id_column=id",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path}/run",
    ]
    run = prepare(compose(ov))  # 007 and 7 are two ids, not a duplicate
    got = open_input(run.input_dir).to_list()
    assert [(r["id"], r["text"], r["n"]) for r in got] == ROWS
    peek = _table([path], fmt).to_pylist()
    assert [(r["id"], r["text"], r["n"]) for r in peek] == ROWS
