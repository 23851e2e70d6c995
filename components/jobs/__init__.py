"""What each kind of job plugs into the one job builder (components/runs.py): `Job`, subclassed by RL's (rl.py), a
stage's (stages.py) and the eval's (evaluation.py) adapter. Whatever differs between kinds is answered by the kind's
own class, here or in its trainer (models/stages/: a StageKind); the builder, the session and the pipeline never ask
a config which kind it is."""

from __future__ import annotations

from models.kinds import BY_JOB, JobKind
from models.loop import DIRECT, Steps


class Job:
    """One kind of job (models/kinds.py declares it: its name, command, configs and whether it publishes a model) and
    the steps the builder runs for it."""

    unit = "step"  # what its progress counts (a checkpoint's number): an RL run's iterations, a stage's steps

    def __init__(self, name: str):
        self.kind: JobKind = BY_JOB[name]

    @property
    def name(self) -> str:
        return self.kind.job

    @property
    def publishes(self) -> bool:
        """Whether the job ends by publishing a model (`publish`), as its kind declares."""
        return self.kind.publishes

    def title(self, run_name: str) -> str:
        """How its log names one of its runs."""
        return f"{self.name} run {run_name}"

    # -- before anything loads
    def prepare(self, cfg) -> tuple[object, object]:
        """(the config with its derived values, its sources pinned; what it reads, read): bad input fails here."""
        raise NotImplementedError

    def tags(self, cfg) -> dict[str, str]:
        """MLflow tags saying what the job is."""
        return {}

    def provenance(self, cfg) -> dict:
        """Its provenance record (components/tracking/provenance.py) from its pinned config."""
        raise NotImplementedError

    def controls(self, cfg) -> bool:
        """Whether this process only controls the job, which runs elsewhere (an RL run on several nodes)."""
        return False

    def control(self, cfg, steps: Steps = DIRECT) -> dict:
        raise NotImplementedError

    # -- its session (components/tracking/run.py)
    def stored(self, cfg, store) -> tuple[object, dict]:
        """What must travel with the job in its store (an RL run's reward files): (the config naming it, its
        record by field)."""
        return cfg, {}

    def logged_config(self, cfg) -> dict:
        """Its config as its MLflow run's parameters (its sources are tags: their digests)."""
        return cfg.model_dump(mode="json", exclude={"sources"})

    def restore_parts(self, cfg) -> tuple[str, ...] | None:
        """The parts of a checkpoint it resumes from (None: all)."""
        return None

    def opened(self, session) -> None:
        """What it does once its session is open (before it runs)."""

    # -- the job itself
    def run(self, session, data, steps: Steps = DIRECT) -> dict:
        raise NotImplementedError

    def publish(self, session, result: dict, steps: Steps = DIRECT) -> dict:
        """Its model out (a kind that `publishes`)."""
        raise NotImplementedError(f"a {self.name} job publishes no model")
