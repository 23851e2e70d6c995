"""Every kind of job is declared once (models/kinds.py): no other table of kinds in the product code, no branch on a
kind's name outside the classes of that kind, and what is derived from the declaration agrees with what Prefect, the
CLI and the pipeline see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

from components.cli.main import DESCRIBED, build_parser
from components.launch.stack import DEPLOYMENTS
from components.pipeline.cache import PREFIXES
from components.runs import JOBS
from models.kinds import KINDS, STAGES

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
NAMES = {name for kind in KINDS for name in (kind.job, kind.command)}
# the pipeline's own structure: which stages a pipeline has, in which order, and the step function of each (its
# hand-offs); the job builder's adapters of the two kinds that are not stages on the ranks (RL's and the eval's)
ALLOWED = {"components/pipeline/config.py", "components/pipeline/run.py", "components/runs.py", "models/kinds.py"}


def test_no_table_of_kinds_outside_their_declaration():
    """A literal tuple, list, set or dict naming two or more kinds of job (by job or command name) outside
    models/kinds.py and the pipeline's structure is a table that must agree with the kinds: derive it instead."""
    found = []
    for folder in ("models", "components", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in ALLOWED:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                elements = (node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                            else [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else [])
                named = {e.value for e in elements if isinstance(e, ast.Constant) and e.value in NAMES}
                if len(named) >= 2:
                    found.append(f"{where}:{node.lineno}: {sorted(named)}")
    assert found == [], "tables of job kinds outside models/kinds.py:\n" + "\n".join(found)


# the pipeline's own structure: which stages it has, in order, and how each stage's job is made from its config
STRUCTURE = {"components/pipeline/config.py", "components/pipeline/run.py", "models/kinds.py"}
# words that name kinds of job and something else where these operands hold them: a data split ('eval'), KTO's loss
# type ('kto')
NOT_A_JOB = {"split", "loss_type"}


def declared(node: ast.ClassDef) -> set[str]:
    """The kinds a class declares itself to be: a name of a kind assigned in its body (`job: ClassVar[str] = 'eval'`,
    `stage = 'sft'`, `name, pairs = 'reward_model', True`)."""
    out = set()
    for statement in node.body:
        value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
        for const in ast.walk(value) if value is not None else ():
            if isinstance(const, ast.Constant) and const.value in NAMES:
                out.add(const.value)
    return out


def kind_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every comparison with a kind's job or command name outside a class of that kind."""
    found = []

    def visit(node: ast.AST, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | declared(node)
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = {c.value for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
                     if isinstance(c, ast.Constant) and c.value in NAMES}
            mentions = {m.id if isinstance(m, ast.Name) else m.attr if isinstance(m, ast.Attribute) else m.value
                        for o in operands for m in ast.walk(o)
                        if isinstance(m, (ast.Name, ast.Attribute)) or isinstance(getattr(m, "value", None), str)}
            if names - own and not mentions & NOT_A_JOB:
                found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, set())
    return found


def test_no_branch_on_a_kinds_name_outside_its_own_class():
    """What differs between kinds is each kind's own (its job adapter in components/jobs/, its trainer in
    models/stages/, its config class): a comparison with a kind's job or command name elsewhere is a branch on the
    kind that its class should answer."""
    found = []
    for folder in ("models", "components", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where not in STRUCTURE:
                found += [f"{where}:{line}: {text}" for line, text in kind_comparisons(ast.parse(path.read_text()))]
    assert found == [], "branches on a kind's name outside its class:\n" + "\n".join(found)


def test_the_branch_check_sees_a_branch_and_spares_a_kinds_own_class():
    caught = kind_comparisons(ast.parse(
        "def f(cfg):\n    return cfg.job == 'rl'\n"
        "class RewardModel:\n    name = 'reward_model'\n    def g(self, cfg):\n        return cfg.stage == "
        "'reward_model'\nclass SFT:\n    name = 'sft'\n    def h(self, cfg):\n        return cfg.stage in ('dpo', "
        "'kto')\ndef k(row):\n    return row['split'] == 'eval'\n"))
    assert caught == [(2, "cfg.job == 'rl'"), (10, "cfg.stage in ('dpo', 'kto')")]


def test_every_kind_has_its_command_flow_deployment_and_prefix():
    deployments = {f"{d['entrypoint'].split(':')[1]}": d
                   for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    commands = build_parser()._subparsers._group_actions[0].choices
    for kind in KINDS:
        assert JOBS[kind.job] is not None and PREFIXES[kind.job] == kind.command
        if kind.job == "rl":
            continue
        assert kind.command in commands and kind.command in DESCRIBED
        if kind.job in STAGES:
            assert f"{kind.command}/default" in DEPLOYMENTS
            entrypoint = deployments[kind.job]["entrypoint"]
            assert entrypoint == f"flows/stages.py:{kind.job}"
            # loaded from its entrypoint, as `prefect deploy` and a worker load it
            assert load_flow_from_entrypoint(str(ROOT / entrypoint)).name == kind.command
