"""Every kind of job is declared once (models/kinds.py): no other table of kinds in the product code, and what is
derived from the declaration agrees with what Prefect, the CLI and the pipeline see."""

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


def test_every_kind_has_its_command_flow_deployment_and_prefix():
    deployments = {f"{d['entrypoint'].split(':')[1]}": d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
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
