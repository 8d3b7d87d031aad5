"""A deterministic corpus of package-description-like texts (no network): N rows
{id, name, text}, a share of them (10% by default) repeating an earlier row's text exactly, as a
package index has (boilerplate summaries, forks, re-uploads).

Texts read like a package index's one-line summaries, sometimes with a second sentence:
"A fast, typed library for parsing TOML configuration files. Supports async I/O and Python 3.9+."
They share beginnings ("A fast ... library for", "Python client for the ... API") as real
summaries do, which is what a prefix cache meets. The same rows, seed and duplicate share always
give the same bytes.
usage: python benchmarks/package_corpus.py OUT.jsonl [--rows 2000] [--duplicates 0.10] [--seed 48]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ADJECTIVES = [
    "fast",
    "lightweight",
    "simple",
    "typed",
    "minimal",
    "pure-Python",
    "async",
    "modern",
    "robust",
    "tiny",
    "extensible",
    "batteries-included",
]
KINDS = ["library", "toolkit", "framework", "package", "module", "command-line tool", "plugin", "wrapper"]
VERBS = [
    "parsing",
    "validating",
    "generating",
    "rendering",
    "converting",
    "caching",
    "scheduling",
    "testing",
    "profiling",
    "serializing",
    "querying",
    "monitoring",
]
OBJECTS = [
    "TOML configuration files",
    "JSON schemas",
    "HTTP requests",
    "SQL queries",
    "Markdown documents",
    "time series",
    "image thumbnails",
    "PDF reports",
    "command-line arguments",
    "environment variables",
    "log files",
    "geospatial data",
    "CSV tables",
    "YAML manifests",
    "unit conversions",
    "Excel spreadsheets",
    "OpenAPI specifications",
    "Kubernetes resources",
    "protocol buffers",
    "email messages",
]
SERVICES = ["GitHub", "Slack", "Stripe", "Twilio", "S3", "Redis", "PostgreSQL", "Elasticsearch", "OpenWeather", "Jira"]
FRAMEWORKS = ["Django", "Flask", "FastAPI", "pytest", "Sphinx", "Jupyter", "pandas", "NumPy", "SQLAlchemy", "Click"]
EXTRAS = [
    "Supports async I/O and Python 3.9+.",
    "Zero dependencies.",
    "Ships type hints and a CLI.",
    "Works on Linux, macOS and Windows.",
    "Includes a pytest plugin.",
    "Drop-in replacement for the standard library module.",
    "Written in Rust with Python bindings.",
    "MIT licensed.",
    "Experimental: the API may change.",
    "Used in production at several companies.",
]
# Summaries a package index holds many times over (its templates' defaults).
BOILERPLATE = [
    "A small example package",
    "Add a short description here!",
    "A Python package.",
    "My first Python package",
    "Utilities",
]


def _name(rng: random.Random, i: int) -> str:
    stem = rng.choice(VERBS).removesuffix("ing") + rng.choice(["ly", "r", "x", "kit", "py", "io", "lib"])
    return f"{stem}-{i}"


def summary(rng: random.Random) -> str:
    """One package's description."""
    form = rng.random()
    if form < 0.55:
        adj = ", ".join(rng.sample(ADJECTIVES, rng.randint(1, 2)))
        article = "An" if adj[0] in "aeiou" else "A"
        text = f"{article} {adj} {rng.choice(KINDS)} for {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    elif form < 0.75:
        text = f"Python client for the {rng.choice(SERVICES)} API, with {rng.choice(VERBS)} of {rng.choice(OBJECTS)}."
    elif form < 0.9:
        text = f"{rng.choice(FRAMEWORKS)} integration for {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    else:
        text = f"Tools for {rng.choice(VERBS)} and {rng.choice(VERBS)} {rng.choice(OBJECTS)} at scale."
    if rng.random() < 0.6:
        text += " " + " ".join(rng.sample(EXTRAS, rng.randint(1, 2)))
    return text


def rows(n: int, duplicates: float = 0.10, seed: int = 48) -> list[dict[str, str]]:
    """n rows; round(n * duplicates) of them repeat an earlier row's text (a third of those the
    index's boilerplate, the rest a random earlier package's summary)."""
    rng = random.Random(seed)
    n_dup = round(n * duplicates)
    # Which rows repeat an earlier one: never row 0, chosen once so the share is exact.
    repeats = set(rng.sample(range(1, n), n_dup)) if n > 1 else set()
    out: list[dict[str, str]] = []
    texts: list[str] = []
    seen: set[str] = set()
    boiler = rng.sample(BOILERPLATE, len(BOILERPLATE))
    for i in range(n):
        if i in repeats and texts:
            boiler_seen = [t for t in boiler if t in seen]
            text = rng.choice(boiler_seen) if boiler_seen and rng.random() < 1 / 3 else rng.choice(texts)
        else:
            text = boiler.pop() if boiler and rng.random() < 0.01 else summary(rng)
            while text in seen:  # a fresh row is a new text: the duplicate share stays exact
                text = summary(rng) + f" Version {rng.randint(1, 9)}.{rng.randint(0, 20)}."
        texts.append(text)
        seen.add(text)
        out.append({"id": f"pkg-{i:05d}", "name": _name(rng, i), "text": text})
    return out


def write(path: Path, n: int, duplicates: float = 0.10, seed: int = 48) -> Path:
    """The corpus as JSONL at path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows(n, duplicates, seed):
            f.write(json.dumps(r) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--duplicates", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=48)
    a = ap.parse_args()
    data = rows(a.rows, a.duplicates, a.seed)
    write(a.out, a.rows, a.duplicates, a.seed)
    share = 1 - len({r["text"] for r in data}) / len(data)
    print(f"{a.out}: {len(data)} rows, {share:.1%} repeat an earlier row's text")


if __name__ == "__main__":
    main()
