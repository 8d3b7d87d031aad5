"""Print topic counts and a few labelled functions from the example's merged output.

usage: python show.py RUN_DIR
"""

from __future__ import annotations

import sys
from collections import Counter

import pyarrow.parquet as pq

rows = pq.read_table(f"{sys.argv[1]}/output.parquet", columns=["id", "text", "error"]).to_pylist()
print(f"{len(rows)} functions labelled; errors: {sum(1 for r in rows if r['error'])}")
for topic, n in Counter(r["text"] for r in rows).most_common():
    print(f"  {topic:<14} {n:>4}")
print("first rows:")
for r in rows[:8]:
    print(f"  {r['id']:<32} {r['text']}")
