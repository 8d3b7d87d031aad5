"""Write the example corpus: public functions of the Python standard library with their docstrings.

Every machine with Python has this text, so the example needs no download.
usage: python make_corpus.py OUT.jsonl [--limit N]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

MODULES = [
    "base64",
    "bisect",
    "calendar",
    "csv",
    "datetime",
    "difflib",
    "email.utils",
    "filecmp",
    "fnmatch",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.cookies",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "math",
    "mimetypes",
    "operator",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "platform",
    "pprint",
    "random",
    "re",
    "secrets",
    "shlex",
    "shutil",
    "socket",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "unicodedata",
    "urllib.parse",
    "uuid",
    "zipfile",
    "zlib",
]


def functions() -> list[dict[str, str]]:
    """One row per public function with a docstring: id, module, name, doc (first paragraph)."""
    rows = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.split("\n\n")[0].strip()
            if len(first) < 20:
                continue
            rows.append({"id": f"{name}.{attr}", "module": name, "name": attr, "doc": first[:600]})
    return rows


def main() -> None:
    """Write the JSONL corpus."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--limit", type=int, default=0, help="keep only the first N functions (0: all)")
    args = ap.parse_args()
    rows = functions()
    if args.limit:
        rows = rows[: args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} functions to {out}")


if __name__ == "__main__":
    main()
