"""Test corpora and what a run's output must be: each row once, in order, with its own answer."""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["dog", "fox", "hello", "world", "label", "physics", "biology", "quick", "lazy", "jumps", "abstract", "brown"]


COMPARE = ["row", "id", "text", "finish_reason", "prompt_tokens", "output_tokens", "error"]


def write_corpus(
    path: Path, n: int, seed: int = 0, fmt: str = "jsonl", min_words: int = 2, max_words: int = 12
) -> list[dict]:
    """n rows {id, text} of random words; as JSONL or Parquet."""
    rng = random.Random(seed)
    rows = [
        {"id": f"doc-{i:05d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))}
        for i in range(n)
    ]
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_output(run_dir: Path) -> list[dict]:
    """The merged output rows of a run directory (one file, split files, or a save_to_disk folder).
    Sealing keeps one copy of a row committed twice, so the output alone cannot show a row that
    was redone: no shard may have dropped one (tests that make duplicates on purpose read theirs)."""
    for done in sorted(run_dir.glob("shards/*/DONE.json")):
        dropped = json.loads(done.read_text()).get("duplicates_dropped")
        assert not dropped, f"{done}: {dropped} rows were committed twice (redone after being committed)"
    if (run_dir / "output" / "state.json").exists():
        import datasets

        return datasets.load_from_disk(str(run_dir / "output")).to_list()
    files = sorted((run_dir / "output").glob("output-*")) or [
        p for p in (run_dir / "output.parquet", run_dir / "output.jsonl") if p.exists()
    ]
    rows: list[dict] = []
    for f in files:
        if f.suffix == ".parquet":
            rows += pq.read_table(f).to_pylist()
        else:
            rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def project(rows: list[dict]) -> list[dict]:
    """The columns two runs of the same config must agree on."""
    return [{k: r.get(k) for k in COMPARE} for r in rows]


def assert_exactly_once(rows: list[dict], inputs: list[dict]) -> None:
    """Every input row once, in input order, with its id, and a text that is the row's own."""
    assert [r["row"] for r in rows] == list(range(len(inputs)))
    assert [r["id"] for r in rows] == [x["id"] for x in inputs]
    for r, x in zip(rows, inputs, strict=True):
        assert r["error"] is None, r
        assert_own_output(r, x["text"])


def assert_own_output(out: dict, prompt_text: str) -> None:
    """The tiny model repeats the prompt's last token: the output text belongs to this row."""
    n = out["output_tokens"]
    unit = out["text"][: len(out["text"]) // n]
    assert unit * n == out["text"] and unit.strip() and prompt_text.endswith(unit.strip()), (out, prompt_text)


# validate and run: one row of each row-level problem; the others are fine (numbers and bools format as text).
BAD_ROWS = [
    {"id": "ok-0", "text": "the quick brown fox"},
    {"id": "missing"},
    {"id": "null", "text": None},
    {"id": "list", "text": ["a", "b"]},
    {"id": "dict", "text": {"a": 1}},
    {"id": "empty", "text": "   "},
    {"id": "long", "text": "abstract " * 300},
    {"id": "number", "text": 42},
    {"id": "bool", "text": True},
    {"id": "params", "text": "hello world", "params": {"bogus": 1}},
]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """rows as JSON lines at path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TIMESTAMP = dt.datetime(2024, 2, 29, 23, 59, 58, 123456)
