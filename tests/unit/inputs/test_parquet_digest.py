"""A Parquet file referenced in place, rewritten after prepare and then touched back to its size and
mtime (what the size/mtime error itself suggests for a touch): a task compares the footer digest in
reference.json and refuses it, naming the file (issue 26). No engine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.errors import InputError
from batchinfer.inputs import reference
from batchinfer.inputs.convert import convert_input, open_input

ROWS = 1000


def row(i: int, text: str = "") -> dict[str, Any]:
    return {"id": f"r{i:05d}", "text": text or f"text of row {i:05d}"}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    # Uncompressed: a text of the same length keeps the file's size to the byte.
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=300, compression="none")


def test_a_rewrite_touched_back_to_size_and_mtime_is_refused(tmp_path: Path) -> None:
    files = []
    for f in range(2):
        files.append(tmp_path / f"part-{f}.parquet")
        write(files[-1], [row(i) for i in range(f * ROWS, (f + 1) * ROWS)])
    dest = tmp_path / "input"
    convert_input(files, "parquet", dest, "id", None)
    assert [p.name for p in dest.iterdir()] == [reference.MANIFEST]  # referenced in place, not copied
    st = files[1].stat()
    # Row 1999's text replaced by one of the same length (and a new largest value): same size, new footer.
    write(files[1], [row(i, "zzzz of row 01999" if i == 1999 else "") for i in range(ROWS, 2 * ROWS)])
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -d @<the old mtime>`
    assert (files[1].stat().st_size, files[1].stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    ds = open_input(dest)
    assert ds.select([0, 999]).to_list() == [row(0), row(999)]  # the untouched file still reads
    with pytest.raises(InputError) as e:
        ds.select([1999])
    digest = json.loads((dest / reference.MANIFEST).read_text())["files"][1]["digest"]
    assert str(e.value).startswith(
        f"{dest / reference.MANIFEST} refers to {files[1]} in place, and it was rewritten since the run was "
        f"prepared: its size and mtime are as they were, but its Parquet footer (row groups, sizes, "
        f"statistics) is not (digest {digest} -> "
    )
    assert "Restore the file as it was prepared, or start a new run in another output.dir" in str(e.value)
    # Restored byte for byte (and its time put back): it reads again, and its rows are the prepared ones.
    write(files[1], [row(i) for i in range(ROWS, 2 * ROWS)])
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_input(dest).select([1999, 1000]).to_list() == [row(1999), row(1000)]


def test_a_file_no_longer_parquet_at_the_same_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    write(path, [row(i) for i in range(ROWS)])
    dest = tmp_path / "input"
    convert_input([path], "parquet", dest, "id", None)
    st = path.stat()
    path.write_bytes(b"x" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(InputError, match=rf"refers to {path} in place, and its Parquet footer cannot be read now"):
        open_input(dest).select([5])


def test_the_footer_is_read_once_per_opening(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check costs one reading of the footer, which the reader then uses (not a second one)."""
    path = tmp_path / "c.parquet"
    write(path, [row(i) for i in range(ROWS)])
    dest = tmp_path / "input"
    convert_input([path], "parquet", dest, "id", None)
    opened: list[Any] = []
    real = pq.ParquetFile

    def parquet_file(source: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(source, (str, Path)):  # the file itself, not the footer bytes parsed in memory
            opened.append(kwargs.get("metadata"))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", parquet_file)
    assert open_input(dest).select([999, 0]).to_list() == [row(999), row(0)]
    assert len(opened) == 1 and opened[0] is not None
