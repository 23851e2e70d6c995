"""The docs site (docs/, mkdocs.yml): its generated pages are what the code and the measurements say, and it builds
with `mkdocs build --strict` (a broken link or anchor, or a page left out of the nav, fails it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from benchmarks.run_all import PAGE
from models.config import RunConfig
from models.deploy import DeployConfig
from models.kinds import KINDS
from models.metrics import entries
from tools.docs import CONFIG_REFERENCE, METRICS, benchmarks_page, config_reference, metrics_page

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "docs" / "reference" / "settings.md"


def leaves(model: type[BaseModel], prefix: str) -> list[str]:
    """Dotted names of every field below `model` that is not itself a section."""
    out = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        default = field.get_default(call_default_factory=True)
        out += leaves(type(default), f"{dotted}.") if isinstance(default, BaseModel) else [dotted]
    return out


def test_config_reference_is_current_and_lists_every_field():
    page = config_reference()
    assert CONFIG_REFERENCE.read_text() == page, "docs/reference/config.md is stale: run `python -m tools.docs`"
    names = leaves(RunConfig, "") + leaves(DeployConfig, "deploy.")
    assert len(names) > 100 and "deploy.actor.nproc_per_node" in names and "model.gradient_checkpointing" in names
    missing = [name for name in names if f"| `{name}` " not in page]  # "| `field` |", or marked advanced
    assert not missing, missing


def test_the_metrics_page_is_generated_and_lists_each_metric_once_per_job():
    """One metric scheme: docs/metrics.md is models/metrics.py's list, where a job's metric has one entry."""
    assert METRICS.read_text() == metrics_page(), "docs/metrics.md is stale: run `python -m tools.docs`"
    for job in [kind.job for kind in KINDS] + ["pipeline"]:
        listed = [name for name, _ in entries(job)]
        assert sorted({n for n in listed if listed.count(n) > 1}) == [], job


def test_the_settings_page_names_only_fields_that_exist():
    """docs/reference/settings.md (the details one sentence leaves out) names fields as `dotted.names`: each is a
    field of one of the config trees (a run's, a deployment's, a pipeline's, a job's, a sweep's, an experiment's)."""
    import typing

    from components.pipeline.config import PipelineFile
    from components.sweep.config import SweepConfig
    from components.sweep.experiment import ExperimentConfig
    from models.config import RLHFConfig
    from models.kinds import JOBS_BUT_RL

    def names(cls, prefix: str = "") -> set[str]:
        out = set()
        for name, field in cls.model_fields.items():
            out.add(f"{prefix}{name}")
            for kind in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    out |= names(kind, f"{prefix}{name}.")
        return out

    known = set().union(*(names(tree) for tree in (RLHFConfig, PipelineFile, SweepConfig, ExperimentConfig,
                                                    *(kind.run_class for kind in JOBS_BUT_RL))))
    named = {token.split("=")[0] for token in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+(?:=[^`]*)?)`",
                                                         SETTINGS.read_text())}
    assert len(named) > 80
    assert sorted(named - known) == []


def test_benchmarks_page_is_generated_from_the_results():
    current = PAGE.read_text()
    assert benchmarks_page(current) == current, "docs/benchmarks.md is stale: run `python -m tools.docs`"
    assert "| memory.json |" in current and "| rloo_vs_trl.json |" in current  # one row per result file


def test_docs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    assert (tmp_path / "site" / "memory" / "index.html").is_file()
