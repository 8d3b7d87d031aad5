"""Print the nearest neighbours of a few functions from the example's merged output, with numpy.

The embeddings are unit vectors (all-MiniLM-L6-v2 normalises them), so cosine similarity is a
dot product, and one matrix product scores a function against every other.
usage: python show.py RUN_DIR [ID ...]
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.parquet as pq

QUERIES = ["zlib.compress", "json.dumps", "os.path.exists", "socket.gethostname", "statistics.median", "re.sub"]
TOP = 5


def load(run_dir: str) -> tuple[list[str], np.ndarray]:
    """Ids and an (n, dim) float32 matrix of unit vectors from DIR/output.parquet (error rows left out)."""
    table = pq.read_table(f"{run_dir}/output.parquet", columns=["id", "embedding", "error"])
    table = table.filter(table.column("error").is_null())
    dim = table.schema.field("embedding").type.list_size
    vectors = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, dim)
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)  # already unit: a no-op kept for other models
    return table.column("id").to_pylist(), vectors


def neighbours(ids: list[str], vectors: np.ndarray, query: str, top: int = TOP) -> list[tuple[str, float]]:
    """The top functions closest to query by cosine, the query itself left out."""
    i = ids.index(query)
    scores = vectors @ vectors[i]
    scores[i] = -np.inf
    best = np.argsort(-scores)[:top]
    return [(ids[j], float(scores[j])) for j in best]


def main() -> None:
    """Print a table of neighbours for each query id present in the run."""
    ids, vectors = load(sys.argv[1])
    print(f"{len(ids)} functions embedded ({vectors.shape[1]} dimensions)")
    queries = [q for q in (sys.argv[2:] or QUERIES) if q in ids] or ids[:3]
    print(f"| function | nearest {TOP} (cosine) |")
    print("|---|---|")
    for q in queries:
        near = ", ".join(f"`{n}` {s:.2f}" for n, s in neighbours(ids, vectors, q))
        print(f"| `{q}` | {near} |")


if __name__ == "__main__":
    main()
