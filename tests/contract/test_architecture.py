"""The package's shape: every stage package says what it owns, module-level imports form no
cycle and never run up the layers, and every login-node module imports without vllm or torch.

Layers, bottom to top (a module imports at module level only its own package or lower ones):
base modules (errors, security, redaction, faults, logs, versions, mounts, durable, locks, ownership,
folder_kinds) < models < config < inputs < requests
< rundir < engine < launch < insight < cli. Only engine/vllm_engine.py imports vllm, inside
functions. The checkers are plain functions, also run on a small synthetic package to show
that they report what they look for."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from support import REPO

ROOT = REPO
PACKAGE = "batchinfer"
SKIPPED_DIRS = {"conf", "__pycache__"}  # conf: YAML data shipped in the wheel

# First name under the package -> layer. "" is the package's own __init__.py.
LAYERS = {
    "": 0,
    "errors": 0,
    "security": 0,
    "redaction": 0,
    "secret_names": 0,
    "secret_shapes": 0,
    "env_refs": 0,
    "faults": 0,
    "logs": 0,
    "versions": 0,
    "mounts": 0,
    "slurm_env": 0,
    "slurm_states": 0,
    "stopsignals": 0,
    "hashing": 0,
    "durable": 0,
    "locks": 0,
    "ownership": 0,
    "folder_kinds": 0,
    "models": 1,
    "config": 2,
    "inputs": 3,
    "requests": 4,
    "rundir": 5,
    "engine": 6,
    "launch": 7,
    "insight": 8,
    "tune": 8,
    "cli": 9,
}
VLLM_IMPORTER = "batchinfer.engine.vllm_engine"
HEAVY = ("vllm", "torch")


# --- the checkers ---------------------------------------------------------------------------


def package_dirs(src: Path, package: str) -> list[Path]:
    """The package's folder and every folder below it holding Python files (conf excluded)."""
    top = src / package
    return [top] + sorted(
        {p.parent for p in top.rglob("*.py") if p.parent != top and not SKIPPED_DIRS & set(p.relative_to(top).parts)}
    )


def undocumented_packages(src: Path, package: str) -> list[str]:
    """Each package folder without an __init__.py or whose __init__.py has no docstring."""
    out = []
    for d in package_dirs(src, package):
        init = d / "__init__.py"
        if not init.is_file():
            out.append(f"{d.relative_to(src).as_posix()}: no __init__.py")
        elif not (ast.get_docstring(ast.parse(init.read_text())) or "").strip():
            out.append(f"{init.relative_to(src).as_posix()}: no docstring")
    return out


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package as its __init__)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        rel = path.relative_to(src)
        if SKIPPED_DIRS & set(rel.parts[1:-1]):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: not inside a function body (a class
    body runs at import, so it counts), not under `if TYPE_CHECKING:`."""

    def walk(stmts: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in stmts:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.orelse)
            else:
                for name in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, name, None) or [])
                for handler in getattr(node, "handlers", None) or []:
                    yield from walk(handler.body)
                for case in getattr(node, "cases", None) or []:
                    yield from walk(case.body)

    yield from walk(tree.body)


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The package's modules an import statement names (a `from X import name` is X.name when
    that is a module, else X)."""

    def known_prefix(name: str) -> Optional[str]:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return None

    if isinstance(node, ast.Import):
        return [m for m in (known_prefix(a.name) for a in node.names) if m]
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = here[: len(here) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        target = known_prefix(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known else known_prefix(base)
        if target:
            out.append(target)
    return out


def find_cycle(graph: dict[str, list[tuple[str, str]]]) -> Optional[list[str]]:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for target, _ in graph.get(node, []):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def tangles(graph: dict[str, list[tuple[str, str]]]) -> list[list[str]]:
    """Every set of modules that import each other in a ring (strongly connected, 2 or more), so
    that one run names them all, not one cycle at a time."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while not ring or ring[-1] != v:
                ring.append(stack.pop())
            if len(ring) > 1:
                out.append(sorted(ring))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe_tangles(graph: dict[str, list[tuple[str, str]]], rings: list[list[str]]) -> str:
    """Each ring with the import statements inside it."""
    lines = []
    for ring in rings:
        lines.append("modules importing each other: " + ", ".join(ring))
        lines += [f"  {w}" for w in dict.fromkeys(w for m in ring for t, w in graph[m] if t in ring)]
    return "\n".join(lines)


def describe_cycle(graph: dict[str, list[tuple[str, str]]], cycle: list[str]) -> str:
    """The cycle with the import statement of each step."""
    steps = []
    for a, b in zip(cycle[:-1], cycle[1:], strict=True):
        where = next(w for t, w in graph[a] if t == b)
        steps.append(f"  {a} -> {b}  ({where})")
    return "import cycle:\n" + "\n".join(steps)


def all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level and inside functions, not under
    `if TYPE_CHECKING:` (that never runs)."""
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            yield node


def import_graph(src: Path, package: str, deferred: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Module -> [(imported module of the package, `file:line: statement`)]: the imports run at
    module level, or with deferred=True also those inside functions."""
    files = module_files(src, package)
    known = set(files)
    graph: dict[str, list[tuple[str, str]]] = {}
    for module, path in files.items():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        edges = []
        for node in all_imports(tree) if deferred else module_level_imports(tree):
            where = f"{path.relative_to(src)}:{node.lineno}: {ast.get_source_segment(source, node)}"
            for target in _resolve(module, path.name == "__init__.py", node, known):
                if target != module:
                    edges.append((target, where))
        graph[module] = edges
    return graph


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(src: Path, package: str) -> list[str]:
    """Each use of another module's private `_name`: `from x import _name` (any level, in
    functions too) and `x._name` where x is a module of the package imported by name."""
    files = module_files(src, package)
    known = set(files)
    out = []
    for module, path in files.items():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        aliases: dict[str, str] = {}  # local name -> module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target, alias in zip(
                    _resolve_each(module, path.name == "__init__.py", node, known), node.names, strict=True
                ):
                    if target is None or target == module:
                        continue
                    if _private(alias.name):
                        out.append(f"{path.relative_to(src)}:{node.lineno}: imports {target}'s {alias.name}")
                    elif f"{_base(module, path.name == '__init__.py', node)}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                out.append(f"{path.relative_to(src)}:{node.lineno}: uses {aliases[node.value.id]}'s {node.attr}")
    return out


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))


def _resolve_each(module: str, is_package: bool, node: ast.ImportFrom, known: set[str]) -> list[Optional[str]]:
    """For each name of a `from X import a, b`: the package module it comes from (X.a when that is
    a module, else X), or None when X is not of the package."""
    base = _base(module, is_package, node)
    return [
        f"{base}.{a.name}" if f"{base}.{a.name}" in known else (base if base in known else None) for a in node.names
    ]


def oversized(src: Path, package: str, max_module: int, max_function: int) -> list[str]:
    """Each module longer than max_module lines and each function longer than max_function."""
    out = []
    for path in module_files(src, package).values():
        source = path.read_text()
        lines = source.count("\n")
        rel = path.relative_to(src)
        if lines > max_module:
            out.append(f"{rel}: {lines} lines (at most {max_module})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_function:
                    out.append(f"{rel}:{node.lineno}: {node.name} is {n} lines (at most {max_function})")
    return out


def loose_dicts(src: Path, package: str, text: str) -> tuple[int, int, list[tuple[str, int]]]:
    """(lines holding `text`, lines in all, [(file, such lines)] heaviest first) over the package's
    modules: as `grep -r TEXT | wc -l` and `wc -l` count them."""
    per_file, lines = [], 0
    for path in module_files(src, package).values():
        source = path.read_text()
        lines += source.count("\n")
        n = sum(text in line for line in source.splitlines())
        if n:
            per_file.append((path.relative_to(src).as_posix(), n))
    per_file.sort(key=lambda item: (-item[1], item[0]))
    return sum(n for _, n in per_file), lines, per_file


def layer_of(module: str, package: str, layers: dict[str, int]) -> Optional[int]:
    first = module[len(package) + 1 :].split(".")[0] if module != package else ""
    return layers.get(first)


def layer_violations(graph: dict[str, list[tuple[str, str]]], package: str, layers: dict[str, int]) -> list[str]:
    """Each module-level import of a higher layer (and each module no layer is assigned to)."""
    out = []
    for module, edges in sorted(graph.items()):
        mine = layer_of(module, package, layers)
        if mine is None:
            out.append(f"{module}: in no layer (add it to LAYERS and the package table of docs/architecture.md)")
            continue
        for target, where in edges:
            theirs = layer_of(target, package, layers)
            if theirs is not None and theirs > mine:
                out.append(f"{module} (layer {mine}) imports {target} (layer {theirs}): {where}")
    return out


# Serializers that write or print a record as JSON or YAML text.
DUMPS = {("json", "dump"), ("json", "dumps"), ("yaml", "dump"), ("yaml", "safe_dump"), ("OmegaConf", "to_yaml")}
DUMPS |= {("OmegaConf", "save")}
# The one redaction: every record derived from a config is written or printed through it.
REDACTION = "batchinfer/redaction.py"
# JSON text that is no config-derived record, each with why (module, function -> reason). A new
# record written with json/yaml directly fails the test: write it with redaction.record_json/record_yaml.
NOT_RECORDS = {
    ("batchinfer/config/fingerprint.py", "fingerprint"): "hashed, never written",
    ("batchinfer/faults.py", "record_engine_start"): "tests' fault log: pid and time",
    ("batchinfer/inputs/datasets_reader.py", "_projected"): "input rows, one column",
    ("batchinfer/inputs/idcheck.py", "check_id_type"): "an input row's id, in an error",
    ("batchinfer/inputs/jsonl_stream.py", "_write_dataset_state"): "the converted input's file list",
    ("batchinfer/inputs/openai_batch.py", "request_row"): "an input row's sampling column",
    ("batchinfer/requests/verdict.py", "_lone_surrogate"): "a sampling value encoded to test it, never kept",
    ("batchinfer/rundir/splice.py", "_with_absolute_images"): "a redo's selected input rows: image cells as JSON text",
    ("batchinfer/inputs/openai_batch.py", "chat_turn"): "an input row's content, in an error",
    ("batchinfer/inputs/reference.py", "reference_fingerprint"): "hashed, never written",
    ("batchinfer/inputs/reference.py", "write_manifest"): "input file names, sizes, digests",
    ("batchinfer/inputs/textfiles.py", "_refuse_lone_surrogates"): "an input value, in an error",
    ("batchinfer/launch/protocol.py", "ExitRecord.to_json"): "a member's exit, on a pipe",
    ("batchinfer/launch/ranks.py", "RankStep.__init__"): "engine args for srun (secret-named keys are refused)",
    ("batchinfer/models/tokens.py", "compile_template.tojson"): "the chat template's tojson filter",
    ("batchinfer/requests/build.py", "row_sampling"): "an input row's sampling overrides",
    ("batchinfer/requests/digest.py", "RequestDigests.__init__"): "hashed, never written",
    ("batchinfer/requests/pooling.py", "pooling_request"): "an engine request's layout",
    ("batchinfer/locks/lock.py", "FileLock._write_record"): "a lock holder: host, pid, job",
    ("batchinfer/locks/lockfile.py", "ExclFile._write_temp"): "a lock holder: host, pid, job",
    ("batchinfer/rundir/output_writer.py", "openai_lines.lines"): "output rows",
    ("batchinfer/rundir/schema.py", "table_to_jsonl"): "output rows",
    ("batchinfer/tune/sample.py", "prompt_key"): "hashed, never written",
    ("batchinfer/tune/sample.py", "read_prompts"): "a prompt's length",
    ("batchinfer/tune/trial.py", "main"): "a trial's messages on a pipe (its parent redacts tune.json)",
    ("batchinfer/durable.py", "write_json"): "its redact=False: plain_json, for the callers listed here",
    ("batchinfer/ownership.py", "_write_mark"): "a folder's maker: command, state, claim token, host, pid",
}


class _Serializers(ast.NodeVisitor):
    """Calls of a DUMPS serializer in one file, with the function (Class.name) they are in."""

    def __init__(self, rel: str):
        self.rel, self.stack = rel, []
        self.found: list[tuple[str, str, str]] = []

    def scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = scoped

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        where = (self.rel, ".".join(self.stack) or "<module>")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in DUMPS:
            self.found.append((*where, f"{f.value.id}.{f.attr}:{node.lineno}"))
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "plain_json":  # the redaction's own unredacted writer
            self.found.append((*where, f"plain_json:{node.lineno}"))
        for kw in node.keywords:  # write_json(..., redact=False)
            if kw.arg == "redact" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                self.found.append((*where, f"{name}(redact=False):{node.lineno}"))
        self.generic_visit(node)


def serializer_calls(src: Path, package: str) -> Iterator[tuple[str, str, str]]:
    """(file, enclosing function as Class.name, `json.dumps:LINE`) of each call of a DUMPS serializer."""
    for path in sorted((src / package).rglob("*.py")):
        visitor = _Serializers(path.relative_to(src).as_posix())
        visitor.visit(ast.parse(path.read_text()))
        yield from visitor.found


def unredacted_writes(src: Path, package: str, not_records: dict[tuple[str, str], str]) -> list[str]:
    """Each JSON/YAML serialization outside the redaction module that is not listed as no record."""
    return [
        f"{rel}: {func} calls {call}"
        for rel, func, call in serializer_calls(src, package)
        if rel != REDACTION.replace("batchinfer", package, 1) and (rel, func) not in not_records
    ]


# A fresh interpreter in which vllm and torch cannot be imported, as on a login node without
# them: imports every module of a package (but the excluded ones) and prints what failed.
IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, traceback

    BLOCKED = {blocked!r}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{{name}} is blocked (a login node without it)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path[:0] = {path!r}
    package, excluded = {package!r}, set({excluded!r})
    failed, imported = {{}}, []

    def onerror(name):
        failed[name] = traceback.format_exc(limit=-3)

    try:
        root = importlib.import_module(package)
    except Exception:
        print(json.dumps({{"failed": {{package: traceback.format_exc(limit=-3)}}}}))
        raise SystemExit
    names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".", onerror)]
    for name in names:
        if name in excluded or name in failed:
            continue
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception:
            failed[name] = traceback.format_exc(limit=-3)
    blocked_imports = {{}}
    for name in sorted(BLOCKED):
        try:
            importlib.import_module(name)
            blocked_imports[name] = "imported"
        except ImportError as e:
            blocked_imports[name] = f"ImportError: {{e}}"
    print(json.dumps({{
        "imported": imported,
        "failed": failed,
        "heavy_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
        "blocked_imports": blocked_imports,
    }}))
    """
)


def import_all_without(package: str, excluded: list[str], blocked: tuple[str, ...], path: list[str]) -> dict:
    script = IMPORT_ALL.format(blocked=set(blocked), path=path, package=package, excluded=excluded)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- batchinfer -----------------------------------------------------------------------------


def test_every_package_has_a_docstring_saying_what_it_owns() -> None:
    names = {d.name for d in package_dirs(ROOT, PACKAGE)}
    assert names >= {"models", "config", "inputs", "requests", "rundir", "engine", "launch", "insight"}
    assert "conf" not in names
    missing = undocumented_packages(ROOT, PACKAGE)
    assert not missing, "packages without a docstring:\n" + "\n".join(missing)


def test_every_record_is_written_through_the_one_redaction() -> None:
    """A JSON or YAML record derived from a config is written or printed only by redaction.py
    (record_json, record_yaml); serializations of other things are listed, each with why."""
    bad = unredacted_writes(ROOT, PACKAGE, NOT_RECORDS)
    assert not bad, "records written around redaction.record_json/record_yaml:\n" + "\n".join(bad)
    listed = {(rel, func) for rel, func, _ in serializer_calls(ROOT, PACKAGE)}
    stale = sorted(set(NOT_RECORDS) - listed)
    assert not stale, f"NOT_RECORDS lists serializations that are gone: {stale}"


def test_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 30 and sum(map(len, graph.values())) > 50  # the parser sees the imports
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(graph, cycle)


def test_no_import_cycle_even_through_imports_inside_functions() -> None:
    """An import moved into a function to break a cycle still ties the two modules together."""
    graph = import_graph(ROOT, PACKAGE, deferred=True)
    rings = tangles(graph)
    assert not rings, describe_tangles(graph, rings)


def test_no_module_uses_another_modules_private_names() -> None:
    found = private_imports(ROOT, PACKAGE)
    assert not found, "private names used across modules (make them public or move them):\n" + "\n".join(found)


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_are_small() -> None:
    found = oversized(ROOT, PACKAGE, MAX_MODULE_LINES, MAX_FUNCTION_LINES)
    assert not found, "split these:\n" + "\n".join(found)


# Records between modules are typed: a dataclass, or a TypedDict where the JSON shape is the on-disk
# or printed contract (run.yaml, progress.json, DONE.json, jobs.jsonl, status/plan/report --json).
# What stays a `dict[str, Any]` is data whose keys are not batchinfer's: a model's config.json, an
# input row, kwargs passed on to vLLM or a chat template, the plain config and its fingerprint keys.
LOOSE_DICT = "dict[str, Any]"
MAX_LOOSE_DICTS_PER_1000_LINES = 8


def test_records_between_modules_are_typed() -> None:
    n, lines, per_file = loose_dicts(ROOT, PACKAGE, LOOSE_DICT)
    assert n and lines > 10_000  # the counter sees the package
    heaviest = ", ".join(f"{f} {k}" for f, k in per_file[:8])
    assert 1000 * n <= MAX_LOOSE_DICTS_PER_1000_LINES * lines, (
        f"{n} `{LOOSE_DICT}` annotations in {lines:,} lines, {1000 * n / lines:.1f} per 1,000 (at most "
        f"{MAX_LOOSE_DICTS_PER_1000_LINES}): give the records a type (a dataclass, a TypedDict for a JSON "
        f"shape) with one reader and writer. The heaviest: {heaviest}"
    )


def test_imports_never_run_up_the_layers() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert any(t == "batchinfer.errors" for t, _ in graph["batchinfer.rundir.store"])
    violations = layer_violations(graph, PACKAGE, LAYERS)
    assert not violations, "imports up the layers:\n" + "\n".join(violations)


# Pairs of packages at one layer where only the first may import the second (anywhere, functions
# too): the report on a run (insight) never depends on the tuner; tune reads run directories and
# uses insight's sizing.
ONE_WAY = [("tune", "insight")]


def one_way_violations(
    graph: dict[str, list[tuple[str, str]]], package: str, one_way: list[tuple[str, str]]
) -> list[str]:
    """Each import from the second package of a pair into the first (the arrow run backwards)."""
    out = []
    for upper, lower in one_way:
        for module, edges in graph.items():
            if module.split(".")[1:2] == [lower]:
                out += [where for target, where in edges if target.split(".")[1:2] == [upper]]
    return out


def test_insight_never_imports_tune() -> None:
    graph = import_graph(ROOT, PACKAGE, deferred=True)
    # the checker sees the arrow that is allowed
    assert any(
        t.startswith("batchinfer.insight") for m, e in graph.items() if m.startswith("batchinfer.tune") for t, _ in e
    )
    violations = one_way_violations(graph, PACKAGE, ONE_WAY)
    assert not violations, "insight imports the tuner (move the record it needs to rundir/):\n" + "\n".join(violations)


def test_one_way_checker_reports_the_arrow_run_backwards(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""p."""',
            "pkg/tune/__init__.py": '"""t."""',
            "pkg/tune/a.py": "from pkg.insight import b\n",
            "pkg/insight/__init__.py": '"""i."""',
            "pkg/insight/b.py": "def f():\n    from pkg.tune import a\n",
        },
    )
    graph = import_graph(tmp_path, "pkg", deferred=True)
    assert one_way_violations(graph, "pkg", [("tune", "insight")]) == ["pkg/insight/b.py:2: from pkg.tune import a"]
    assert one_way_violations(import_graph(tmp_path, "pkg"), "pkg", [("tune", "insight")]) == []


def test_only_vllm_engine_imports_vllm_and_only_inside_functions() -> None:
    """Statically, anywhere in a module (functions too): vllm only in engine/vllm_engine.py,
    and there never at module level; torch never at module level."""
    offenders = []
    for module, path in module_files(ROOT, PACKAGE).items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in module_level_imports(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                root = name.split(".")[0]
                if root == "vllm" and (module != VLLM_IMPORTER or id(node) in top):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {name}")
                if root == "torch" and id(node) in top:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {name} at module level")
    assert not offenders, "\n".join(offenders)


def test_every_login_node_module_imports_without_vllm_and_torch() -> None:
    # Installed here, so the block below (not their absence) is what keeps them out.
    assert importlib.util.find_spec("torch") is not None and importlib.util.find_spec("vllm") is not None
    result = import_all_without(PACKAGE, [VLLM_IMPORTER], HEAVY, [str(ROOT)])
    assert not result["failed"], "\n".join(f"{name}:\n{tb}" for name, tb in result["failed"].items())
    expected = set(module_files(ROOT, PACKAGE)) - {VLLM_IMPORTER}
    assert expected <= set(result["imported"]), sorted(expected - set(result["imported"]))
    assert VLLM_IMPORTER not in result["imported"]
    assert result["heavy_loaded"] == [], result["heavy_loaded"]
    # The block works: in that interpreter `import torch` / `import vllm` fail.
    for name in HEAVY:
        assert result["blocked_imports"][name].startswith("ImportError"), result["blocked_imports"]


# --- the checkers find what they look for ---------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


SYNTHETIC_LAYERS = {"": 0, "base": 0, "low": 1, "high": 2}


def test_checkers_report_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""Synthetic."""\n',
            "pkg/base.py": "import os\n",
            "pkg/low/__init__.py": '"""Low."""\n',
            "pkg/low/a.py": "from pkg.low import b\n",
            "pkg/low/b.py": "from . import c\n",
            "pkg/low/c.py": "import pkg.low.a\nfrom pkg.base import os\n",
            "pkg/low/up.py": "from pkg.high.y import thing\n",
            "pkg/low/lazy.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.high import y
                def f():
                    from pkg.high import y
                """,
            "pkg/high/__init__.py": "",
            "pkg/high/y.py": "from pkg.low import a\nthing = 1\n",
            "pkg/odd.py": "",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.low.lazy"] == []  # TYPE_CHECKING and function-level imports do not count
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"pkg.low.a", "pkg.low.b", "pkg.low.c"}
    assert cycle[0] == cycle[-1] and len(cycle) == 4
    text = describe_cycle(graph, cycle)
    assert "pkg/low/b.py:1: from . import c" in text and "pkg/low/c.py:1: import pkg.low.a" in text

    violations = layer_violations(graph, "pkg", SYNTHETIC_LAYERS)
    assert violations == [
        "pkg.low.up (layer 1) imports pkg.high.y (layer 2): pkg/low/up.py:1: from pkg.high.y import thing",
        "pkg.odd: in no layer (add it to LAYERS and the package table of docs/architecture.md)",
    ]

    # A package folder without a docstring or without __init__.py is reported.
    (tmp_path / "pkg/orphan").mkdir()
    (tmp_path / "pkg/orphan/z.py").write_text("")
    assert undocumented_packages(tmp_path, "pkg") == [
        "pkg/high/__init__.py: no docstring",
        "pkg/orphan: no __init__.py",
    ]

    # Without the cycle's closing import, none is found.
    (tmp_path / "pkg/low/c.py").write_text("from pkg.base import os\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_checkers_report_deferred_cycles_private_names_and_sizes(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""Synthetic."""\n',
            "pkg/a.py": "from pkg import b\n_hidden = 1\n",
            "pkg/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.c import _typed
                def f():
                    import pkg.a as mod_a
                    from pkg.a import _hidden, public
                    return _hidden, mod_a._hidden, mod_a.public
                """,
            "pkg/c.py": "_typed = 1\n",
            "pkg/big.py": "x = 1\n" * 5 + "def long():\n" + "    y = 1\n" * 4 + "    return y\n",
        },
    )
    # Module level: a -> b only. With the imports inside functions: b -> a as well, a cycle.
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
    cycle = find_cycle(import_graph(tmp_path, "pkg", deferred=True))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.b"}
    assert tangles(import_graph(tmp_path, "pkg")) == []
    assert tangles(import_graph(tmp_path, "pkg", deferred=True)) == [["pkg.a", "pkg.b"]]
    # The TYPE_CHECKING import never runs, so it makes no edge; it still names a private name.
    assert all(t != "pkg.c" for t, _ in import_graph(tmp_path, "pkg", deferred=True)["pkg.b"])
    assert private_imports(tmp_path, "pkg") == [
        "pkg/b.py:4: imports pkg.c's _typed",
        "pkg/b.py:7: imports pkg.a's _hidden",
        "pkg/b.py:8: uses pkg.a's _hidden",
    ]
    assert oversized(tmp_path, "pkg", max_module=8, max_function=5) == [
        "pkg/big.py: 11 lines (at most 8)",
        "pkg/big.py:6: long is 6 lines (at most 5)",
    ]
    assert oversized(tmp_path, "pkg", max_module=11, max_function=6) == []


def test_loose_dict_counter_counts_lines_as_grep_does(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""Synthetic."""\n',
            "pkg/a.py": "from typing import Any\ndef f(x: dict[str, Any]) -> dict[str, Any]:\n    return x\n",
            "pkg/b.py": "y: dict[str, Any] = {}\nz: dict[str, int] = {}\n",
            "pkg/conf/c.py": "w: dict[str, Any] = {}\n",  # conf: data, not the package's code
        },
    )
    n, lines, per_file = loose_dicts(tmp_path, "pkg", "dict[str, Any]")
    assert (n, lines) == (2, 6)  # two lines hold it (one of them twice); 1 + 3 + 2 lines in all
    assert per_file == [("pkg/a.py", 1), ("pkg/b.py", 1)]


def test_checker_reports_a_record_written_around_the_redaction(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""Synthetic."""\n',
            "pkg/redaction.py": "import json\ndef record_json(x):\n    return json.dumps(x)\n",
            "pkg/job.py": """
                import json, yaml
                from omegaconf import OmegaConf
                class Job:
                    def save(self, path, cfg):
                        path.write_text(json.dumps(cfg))
                def show(cfg):
                    print(OmegaConf.to_yaml(cfg), yaml.safe_dump(cfg))
                def digest(keys):
                    return hash(json.dumps(keys))
                def mark(path, rec):
                    write_json(path, rec, redact=False)
                """,
        },
    )
    assert unredacted_writes(tmp_path, "pkg", {("pkg/job.py", "digest"): "hashed"}) == [
        "pkg/job.py: Job.save calls json.dumps:6",
        "pkg/job.py: show calls OmegaConf.to_yaml:8",
        "pkg/job.py: show calls yaml.safe_dump:8",
        "pkg/job.py: mark calls write_json(redact=False):12",
    ]


def test_import_check_reports_a_module_that_needs_torch(tmp_path: Path) -> None:
    """The same interpreter set-up fails a module importing torch, names it, and keeps the
    excluded module out."""
    _write(
        tmp_path,
        {
            "heavypkg/__init__.py": '"""Synthetic."""\n',
            "heavypkg/light.py": "import json\n",
            "heavypkg/sub/__init__.py": "",
            "heavypkg/sub/uses_torch.py": "import torch\n",
            "heavypkg/sub/lazy_torch.py": "def f():\n    import torch\n",
            "heavypkg/engine.py": "import vllm\n",
        },
    )
    result = import_all_without("heavypkg", ["heavypkg.engine"], HEAVY, [str(tmp_path)])
    assert set(result["failed"]) == {"heavypkg.sub.uses_torch"}
    assert "torch is blocked" in result["failed"]["heavypkg.sub.uses_torch"]
    assert set(result["imported"]) == {"heavypkg", "heavypkg.light", "heavypkg.sub", "heavypkg.sub.lazy_torch"}
    assert result["heavy_loaded"] == []
