"""The import graph of the project: no cycles (imports inside functions included), and no import inside a function
except a heavy or optional third-party one that says so in a trailing comment.

Every module of components/, models/, flows/ and benchmarks/ is parsed with `ast` (nothing is imported: the graph is
components/tracking/code.py's, the one a job's code version is computed from). `import a.b`
and `from a import b` count as importing `a.b` when that is a project module, and `a`, its package, unless `a` is a
package of the importing module itself (always imported before it) and is not imported for a name of its own
(`from a import name_in_a_init`). Imports under `if TYPE_CHECKING:` count too (a cycle there is still a cycle).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from components.tracking.code import PACKAGES, import_graph, imports, project_modules, targets
from components.tracking.code import ROOT as CODE_ROOT

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
assert ROOT == CODE_ROOT  # the graph of the project's modules is the one components/tracking/code.py reads


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, first repeated at the end) per strongly connected component."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:  # Tarjan; the graph is small, recursion depth is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(path_through(min(component), component))

    def path_through(start: str, component: set[str]) -> list[str]:
        """A shortest cycle from `start` back to itself inside the component (breadth first)."""
        parents, frontier = {start: None}, [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        path = [v]
                        while parents[path[-1]] is not None:
                            path.append(parents[path[-1]])
                        return [*reversed(path), start]
                    if w not in parents:
                        parents[w] = v
                        nxt.append(w)
            frontier = nxt
        return [start]

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_cycles_between_the_subpackages_of_components():
    """components/ by concern: launch <- storage, tracking <- serving <- cli (and tasks, flows), never back."""
    def room(module: str) -> str:  # components.serving.triton.serve -> components.serving; components.tasks stays
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    graph = {}
    for name, imported in import_graph().items():
        if name.startswith("components."):
            graph.setdefault(room(name), set()).update(
                room(m) for m in imported if m.startswith("components.") and room(m) != room(name))
    found = cycles(graph)
    assert found == [], "cycles between the parts of components/:\n" + "\n".join(" -> ".join(c) for c in found)


ROLLOUT_SERVER = (*(f"components.serving.rollout.{m}" for m in ("app", "weights", "body", "main", "group", "openai")),
                  "models.chat",  # the chat templates and tool-call parsing, the trainer's too
                  "models.rendezvous",  # the weight-transfer group's admission by the run's secret, the trainer's too
                  "components.handshake", "components.serving.connections")  # the run's wire auth, its connections


def test_the_rollout_server_imports_nothing_of_the_project():
    """The vLLM rollout server runs in .venv-vllm, which has none of the project's dependencies: its modules import
    only each other and third-party packages (not its client, components/serving/rollout/client.py), and the packages
    `python -m components.serving.rollout.main` runs through import nothing at all."""
    known = project_modules()
    bad = []
    for name in ("components", "components.serving", "components.serving.rollout", "models"):
        bad += [f"{known[name].relative_to(ROOT)}:{line}: {text[0].strip()}  (a package the rollout server runs "
                "through)"
                for module, _, line, _, text in imports(known[name], name) if module != "__future__"]
    for name in ROLLOUT_SERVER:
        bad += [f"{known[name].relative_to(ROOT)}:{line}: {text[0].strip()}"
                for module, _, line, _, text in imports(known[name], name)
                if module.split(".")[0] in (*PACKAGES, "tests") and module not in ROLLOUT_SERVER]
    assert bad == [], "the rollout server imports the project:\n" + "\n".join(bad)


TRANSPORT = ("httpx", "requests", "urllib", "http", "aiohttp", "tritonclient", "pytriton", "fastapi", "uvicorn",
             "prefect", "mlflow", "boto3")


def test_models_import_no_transport_and_nothing_of_components_or_flows():
    """models/ holds the torch/transformers/peft code and the RL math: how requests and weights travel (HTTP,
    Triton) and orchestration live in components/; models/ speaks to them through protocols."""
    bad = []
    for name, path in project_modules().items():
        if not name.startswith("models"):
            continue
        for module, names, line, _, text in imports(path, name):
            full = [module] + [f"{module}.{n}" for n in names]
            if module.split(".")[0] in ("components", "flows") or any(
                    m == t or m.startswith(f"{t}.") for m in full for t in TRANSPORT):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text[0].strip()}")
    assert bad == [], "models/ imports what belongs to components/:\n" + "\n".join(bad)


def test_imports_inside_functions_are_third_party_and_explained():
    known = project_modules()
    bad = []
    for name, path in known.items():
        for module, _, line, inside, text in imports(path, name):
            if not inside:
                continue
            top = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}: {text[0].strip()}"
            if top in PACKAGES:
                bad.append(f"{where}  (a project module: import it at the top of the module)")
            elif top in sys.stdlib_module_names:
                bad.append(f"{where}  (the standard library: import it at the top of the module)")
            elif not any("#" in t and t.split("#", 1)[1].strip() for t in text):
                bad.append(f"{where}  (a heavy/optional dependency imported here needs a trailing comment saying why)")
    assert bad == [], "imports inside functions:\n" + "\n".join(bad)


def test_the_checks_see_what_they_check(tmp_path):
    """A cycle is named in order; imports inside functions and relative imports are found; `from pkg import module`
    counts as importing the module, and a module's own packages do not count."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    source = tmp_path / "x.py"
    source.write_text("from . import main\n\n\ndef f():\n    import torch  # heavy: only f\n    from ..tasks import "
                      "run\n")
    assert [(m, names, line, inside) for m, names, line, inside, _ in imports(source, "components.cli.x")] == [
        ("components.cli", ["main"], 1, False), ("torch", [], 5, True), ("components.tasks", ["run"], 6, True)]
    known = {"components": ROOT, "components.tasks": ROOT, "components.cli": ROOT, "components.cli.main": ROOT}
    assert targets("flows.ppo", "components", ["tasks"], known) == {"components", "components.tasks"}
    assert targets("components.cli.main", "components.tasks", [], known) == {"components.tasks"}
    assert targets("components.cli.x", "components.cli", ["main"], known) == {"components.cli.main"}
    assert targets("components.cli.x", "components.cli", ["helper"], known) == {"components.cli"}  # its __init__
    assert "components.tasks" in project_modules()


def loaded_at_start(entry: str) -> tuple[set[str], set[str]]:
    """(project modules, third-party modules) that `python -m entry` imports before it runs: the closure of the
    imports outside functions (those under `if TYPE_CHECKING:` included, which only makes it larger)."""
    known = project_modules()
    project, third_party, todo = set(), set(), [entry]
    while todo:
        name = todo.pop()
        if name in project:
            continue
        project.add(name)
        for module, names, _, inside, _ in imports(known[name], name):
            if inside:
                continue
            found = targets(name, module, names, known)
            todo += sorted(found)
            if module.split(".")[0] not in (*PACKAGES, "tests", "__future__") and module not in sys.stdlib_module_names:
                third_party |= {module} | {f"{module}.{n}" for n in names}
    return project, third_party


def test_a_critic_or_reward_server_process_starts_without_the_actors_training_code():
    """A Triton server (`python -m components.serving.triton.main`, started for every run with a critic or reward
    server, and once more per follower rank of a 2-rank critic) loads the critic or the reward model: not the actor's
    loop, policy and sharded-weights code (models/loop.py and what it imports: torch.distributed.tensor, peft's LoRA),
    nor MLflow or Prefect. Its followers come from components/launch/followers.py, not from the actor's ranks."""
    project, third_party = loaded_at_start("components.serving.triton.main")
    actor = {"models.loop", "models.actor", "models.policy", "models.step", "components.launch.ranks"}
    assert project & actor == set(), f"the server process imports the actor's code: {sorted(project & actor)}"
    heavy = ("torch.distributed.tensor", "torch.distributed.fsdp", "mlflow", "prefect")
    loaded = sorted(m for m in third_party if any(m == h or m.startswith(f"{h}.") for h in heavy))
    assert loaded == [], f"the server process imports at start: {loaded}"


def test_a_run_outside_prefect_starts_without_prefect():
    """`rlhf train` and the ranks of a run's node groups (`python -m components.runs`) run jobs without Prefect: a
    run's servers are its own processes or its own pods, never Prefect's (components/serving/services.py)."""
    for entry in ("components.runs", "components.cli.commands"):
        _, third_party = loaded_at_start(entry)
        loaded = sorted(m for m in third_party if m.split(".")[0] == "prefect")
        assert loaded == [], f"{entry} imports Prefect at start: {loaded}"
