"""The code a job runs, by content: the code version in a job's provenance record (provenance.py), so in a pipeline
stage's key. Light: `ast` and hashlib only; nothing is imported.

A job's code is every project module its processes import: the closure of imports (found statically) from its
processes' entry points (`JOB_ENTRY_MODULES`: the job builder, which every job runs through and every rank of a node
group runs, and each process a job starts with `python -m`: a follower rank, a node group, a server, a worker) and
from the modules the kinds of job name to be imported when used (models/kinds.py: their configs and trainers). An
import counts wherever it stands (inside a function, under TYPE_CHECKING). Each module counts by its syntax tree
without docstrings and without positions (`normalised`): a docstring, a comment, a blank line or a reformatting
changes nothing; any change of what the code does changes the digest. A module no job imports (the CLI, the
pipeline's and sweeps' orchestration, the flows, the benchmarks) is not in it.

Static, not `sys.modules` after an import: the same code gives the same digest in every process whatever it imported
before (a pipeline's process has imported more than a job's; a module imported inside a function is there only once
that function ran), and the digest covers the processes the job starts, which its own process never imports.

Parsing every module takes ~1.5 CPU-s, in every process that builds a job. `job_code_digest(cache)` does it once per
content of the checkout: the digest is a function of the modules' bytes and of Python's syntax trees alone, so it is
kept in the cache directory under the sha256 of those bytes and of the Python version (`source_key`, a few ms); any
edit of any module is another key, so a cached digest is never stale.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from models.kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("components", "models", "flows", "benchmarks")  # the project's modules (tests, tools and examples aside)
# the entry point of every process of a job: the job builder (and the ranks of a node group: `python -m
# components.runs`), a follower rank, a node group, a critic or reward server (rank 0, its followers, a server pod),
# the rollout server, a verifiers worker, an environment worker
JOB_ENTRY_MODULES = ("components.runs", "components.launch.ranks", "components.launch.nodes",
                     "components.serving.triton.main", "components.serving.pod", "components.serving.rollout.main",
                     "components.verifiers.worker", "models.environments.worker")
# and what the kinds of job name to be imported when used: their run configs and trainers
KIND_MODULES = tuple(sorted({path.partition(":")[0] for kind in KINDS for path in (kind.config, kind.run, kind.trainer)
                             if path}))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every project module under `root`, by its dotted name."""
    return {module_name(path, root): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def imports(path: Path, name: str,
            tree: ast.Module | None = None) -> Iterator[tuple[str, list[str], int, bool, list[str]]]:
    """(module, imported names (none for `import module`), line, inside a function, the statement's source lines) for
    every import statement of the module `name` at `path` (`tree`: its syntax tree, parsed already)."""
    source = path.read_text()
    lines = source.splitlines()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                text = lines[child.lineno - 1:child.end_lineno]
                for alias in child.names:
                    yield alias.name, [], child.lineno, inside, text
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from . import x, from ..a import b
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                yield base, [alias.name for alias in child.names], child.lineno, inside, \
                    lines[child.lineno - 1:child.end_lineno]
            else:
                yield from visit(child, inside)

    return visit(tree or ast.parse(source, str(path)), False)


def targets(importer: str, module: str, names: list[str], known: dict[str, Path]) -> set[str]:
    """The project modules an import statement in `importer` depends on: `import module` -> module;
    `from module import names` -> the submodules named, and module itself when a name is not a submodule; plus the
    packages on the way, except the importer's own packages (always imported before it)."""
    submodules = {f"{module}.{n}" for n in names if f"{module}.{n}" in known}
    explicit = submodules | ({module} if len(submodules) < len(names) or not names else set())
    parts, own = module.split("."), importer.split(".")
    implicit = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - {".".join(own[:i]) for i in range(1, len(own))}
    return ((explicit | implicit) & known.keys()) - {importer}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the project modules it imports} of every project module under `root`."""
    known = project_modules(root)
    return {name: {target for module, names in parsed(name, str(path), path.read_text())[0]
                   for target in targets(name, module, list(names), known)}
            for name, path in known.items()}


@lru_cache(maxsize=1024)
def parsed(name: str, path: str, source: str) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], str]:
    """(its import statements as (module, names), its `normalised` code) of the module `name` at `path` holding
    `source`, parsed once per source in a process: a copy of the checkout with one module edited parses that one."""
    tree = ast.parse(source, path)
    found = tuple((module, tuple(names)) for module, names, _, _, _ in imports(Path(path), name, tree))
    return found, normalised(tree)


def closure(graph: dict[str, set[str]], roots: tuple[str, ...]) -> set[str]:
    """`roots` and every module they import, directly or not."""
    seen, todo = set(), [root for root in roots if root in graph]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module] - seen)
    return seen


def normalised(tree: ast.Module) -> str:
    """A module's code without what does not run: its syntax tree without docstrings (the first string statement of
    the module, a class or a function) and without positions (comments and layout are not in the tree). Strips the
    docstrings of `tree` in place."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def code_digest(root: Path = ROOT, roots: tuple[str, ...] = JOB_ENTRY_MODULES + KIND_MODULES) -> str:
    """sha256 over the normalised code of every module in the closure of `roots` under `root`, by name."""
    known = project_modules(root)
    out = hashlib.sha256()
    for name in sorted(closure(import_graph(root), roots)):
        out.update(f"{name}\0{parsed(name, str(known[name]), known[name].read_text())[1]}\n".encode())
    return out.hexdigest()


def source_key(root: Path = ROOT) -> str:
    """sha256 over the Python version and the bytes of every project module under `root`, by name: all that
    `code_digest` is computed from."""
    out = hashlib.sha256(f"{sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for name, path in sorted(project_modules(root).items()):
        data = path.read_bytes()
        out.update(f"{name}\0{len(data)}\0".encode() + data)
    return out.hexdigest()


@lru_cache(maxsize=4)
def job_code_digest(cache: Path | None = None) -> str:
    """The digest of a job's code in this checkout (`code_digest`), computed once per process; with `cache` (a
    directory), once per content of the checkout: read from, or written to, <cache>/code-digest/<source_key>. A cache
    that cannot be read or written is passed by (the digest is computed)."""
    if cache is None:
        return code_digest()
    entry = cache / "code-digest" / source_key()
    try:
        found = entry.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", found):
            return found
    except OSError:
        pass
    value = code_digest()
    try:  # beside it, then renamed: a reader sees the whole digest or none
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False) as tmp:
            tmp.write(value)
        os.replace(tmp.name, entry)
    except OSError:
        pass
    return value
