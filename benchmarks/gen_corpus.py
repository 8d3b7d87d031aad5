"""Synthetic JSONL corpus for the scale benchmarks: N rows of ~415 bytes (or ~58 with --short), deterministic.

Each row: a unique string id, a text of ~300 characters, and a nested meta object (source, language,
a score, a list of tags). Short rows (issue 44's "2 million short JSON lines"): an id and a text of
3-8 words, nothing else. The same N and seed always give the same bytes.
usage: python benchmarks/gen_corpus.py OUT.jsonl --rows 1000000 [--seed 0] [--short]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are were not but his "
    "had have they one all their been has its more when who will also into other there than some first "
    "after two time new these them over such only most can may would about many then could between used "
    "city during under known while where later both through system since years part three number state"
).split()
SOURCES = ["crawl", "books", "news", "forum", "wiki", "code"]
LANGS = ["en", "de", "fr", "es"]
TAGS = ["a", "bb", "ccc", "dddd", "news", "long", "short", "x"]
POOL = 4096  # distinct texts; a row's own number keeps every text unique


def _texts(rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(55, 63))) for _ in range(POOL)]


def lines(rows: int, seed: int = 0, start: int = 0) -> list[str]:
    """Rows [start, start + rows) of the corpus as JSON lines (ASCII, no escaping needed)."""
    rng = random.Random(seed)
    texts = _texts(rng)
    out = []
    for i in range(start, start + rows):
        h = (i * 2654435761 + seed) & 0xFFFFFFFF
        tags = '", "'.join(TAGS[(h >> s) & 7] for s in (3, 9, 15)[: 1 + h % 3])
        out.append(
            f'{{"id": "doc-{i:09d}", "text": "row {i}: {texts[h % POOL]}", '
            f'"meta": {{"source": "{SOURCES[h % 6]}", "lang": "{LANGS[(h >> 4) % 4]}", '
            f'"score": {(h % 10000) / 100:.2f}, "tags": ["{tags}"]}}}}\n'
        )
    return out


def short_lines(rows: int, seed: int = 0, start: int = 0) -> list[str]:
    """Rows [start, start + rows) of the short corpus: {"id": "q00000042", "text": "3 to 8 words"}."""
    out = []
    for i in range(start, start + rows):
        h = (i * 2654435761 + seed) & 0xFFFFFFFF
        words = " ".join(WORDS[(h >> (4 * k)) % len(WORDS)] for k in range(3 + h % 6))
        out.append(f'{{"id": "q{i:08d}", "text": "{words}"}}\n')
    return out


def write(path: Path, rows: int, seed: int = 0, batch: int = 100_000, short: bool = False) -> int:
    """Write the corpus to path; return its size in bytes."""
    make = short_lines if short else lines
    with open(path, "w", encoding="ascii") as f:
        for start in range(0, rows, batch):
            f.writelines(make(min(batch, rows - start), seed, start))
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--short", action="store_true", help="~58-byte rows: an id and a few words")
    a = ap.parse_args()
    size = write(a.out, a.rows, a.seed, short=a.short)
    print(f"{a.out}: {a.rows} rows, {size} bytes ({size / max(a.rows, 1):.0f} bytes a row)")


if __name__ == "__main__":
    main()
