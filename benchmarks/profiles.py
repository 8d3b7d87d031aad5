"""Benchmark rows built from text every Python install has: the standard library's functions.

Three profiles like vLLM's published benchmarks, each with fixed row counts and a stated
duplicate rate (a share of rows repeating an earlier row's text, as real corpora do).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MODULES = [
    "argparse", "base64", "calendar", "collections", "csv", "datetime", "difflib", "email.utils",
    "fnmatch", "functools", "glob", "gzip", "heapq", "html", "inspect", "ipaddress", "json",
    "logging", "mimetypes", "os", "pathlib", "pickle", "pprint", "random", "re", "shlex",
    "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "urllib.parse", "uuid", "zipfile",
]  # fmt: skip
TOPICS = ["files", "text", "math", "time", "networking", "data formats", "concurrency", "system", "other"]
CLASSIFY_SYSTEM = (
    "You are labelling the functions of a programming language's standard library by topic, "
    "for a search index used by thousands of developers. Read the function's name and the "
    "first line of its documentation, then answer with exactly one topic from this list: "
    + ", ".join(TOPICS)
    + ". Use 'files' for anything about paths, directories, archives or file contents; 'text' "
    "for string processing, parsing of human text, formatting and regular expressions; 'math' "
    "for numbers, statistics and randomness; 'time' for dates, clocks and calendars; "
    "'networking' for URLs, sockets, e-mail and HTTP; 'data formats' for JSON, CSV, pickle, "
    "base64 and similar encodings; 'concurrency' for threads, processes and locks; 'system' for "
    "the operating system, environment and interpreter; 'other' when nothing fits. Answer with "
    "the topic only, in lower case, without punctuation or explanation."
)


@dataclass(frozen=True)
class Profile:
    """One benchmark workload."""

    name: str
    rows: int
    duplicate_rate: float
    max_tokens: int
    system: Optional[str] = None
    choice: Optional[list[str]] = None


PROFILES = {
    "chat": Profile("chat", rows=128, duplicate_rate=0.10, max_tokens=64),
    "classification": Profile(
        "classification", rows=192, duplicate_rate=0.30, max_tokens=4, system=CLASSIFY_SYSTEM, choice=TOPICS
    ),
    "codegen": Profile("codegen", rows=32, duplicate_rate=0.0, max_tokens=160),
    # More rows than the streaming worker's first window (2 x max_num_seqs = 512 at vLLM's CPU
    # default of 256), so window order, duplicates across windows and the result cache are measured,
    # not a whole-shard view; short answers keep a run near 4 minutes on 2 cores.
    "chat-windows": Profile("chat-windows", rows=640, duplicate_rate=0.10, max_tokens=16),
}
# chat-windows asks several questions of each function (the standard library alone has ~300).
QUESTIONS = [
    "In two sentences, what does Python's {name} do and when would I use it?",
    "Give one short example call of Python's {name} and say what it returns.",
    "What is a common mistake when using Python's {name}? Answer briefly.",
    "Which argument of Python's {name} matters most, and why? One sentence.",
    "Name a standard library alternative to Python's {name} and compare them briefly.",
    "Explain Python's {name} to a beginner in one sentence.",
    "Is Python's {name} safe to call from several threads at once? Answer briefly.",
]


def functions() -> list[tuple[str, str, str]]:
    """(qualified name, docstring, source) of public stdlib functions, in a fixed order."""
    out = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if doc:
                out.append((f"{mod_name}.{name}", doc, src))
    return out


def texts(profile: Profile) -> list[str]:
    """The distinct prompt texts a profile draws from."""
    out = []
    for name, doc, src in functions():
        first = doc.split("\n\n")[0].replace("\n", " ")
        if profile.name == "chat":
            out.append(f"In two sentences, what does Python's {name} do and when would I use it?\n\n{first}")
        elif profile.name == "chat-windows":
            out += [q.format(name=name) + f"\n\n{first}" for q in QUESTIONS]
        elif profile.name == "classification":
            out.append(f"{name}: {first}")
        elif 600 <= len(src) <= 2400:
            body = textwrap.dedent(src)
            out.append(f"Rewrite this function with type hints and a short docstring:\n\n```python\n{body}```")
    return out


def make_rows(profile: Profile, duplicate_rate: float, seed: int = 0) -> list[dict[str, str]]:
    """profile.rows rows {id, text}; round(rows x duplicate_rate) of them repeat an earlier text."""
    rng = random.Random(seed)
    pool = texts(profile)
    rng.shuffle(pool)
    n_dup = round(profile.rows * duplicate_rate)
    unique = pool[: profile.rows - n_dup]
    if len(unique) < profile.rows - n_dup:
        raise SystemExit(f"{profile.name}: only {len(pool)} distinct texts for {profile.rows - n_dup} rows")
    chosen = unique + [rng.choice(unique) for _ in range(n_dup)]
    rng.shuffle(chosen)
    return [{"id": f"{profile.name}-{i:05d}", "text": t} for i, t in enumerate(chosen)]


def write_rows(rows: list[dict[str, str]], path: Path) -> None:
    """JSON lines."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
