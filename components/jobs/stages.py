"""What a stage that trains on the actor's ranks plugs into the job builder (components/runs.py): SFT, a reward model,
DPO, KTO (models/stages/train.py, dpo.py and kto.py say what each trains).

    prepare    what it reads pinned (models/resolve.py), its rows read with the model's tokenizer: bad data fails
               here, before any model loads
    provenance its record: the training fields of its section, its rows (and, when its model carries what its
               held-out eval measured, its held-out rows), the model it trains from as pinned, the code
    run        the trainee on the actor's ranks (components/launch/ranks.py), restored from the job's checkpoint;
               the one training loop (models/loop.run_loop: the stage's `StageSteps`, recorded by `StageRecord`): the
               held-out eval before the first step, optimizer steps in segments between checkpoints and evals, the
               eval after the last step
    publish    the last checkpoint's model as a plain HF model directory (components/export.py, the one export: LoRA
               merged onto its digest-checked base, the stage's dtype and task; what its trainer adds to its
               config.json, a reward model's reward statistics) stored beside the checkpoints with the sha256 of
               every file
"""

from __future__ import annotations

from dataclasses import dataclass

from components.export import publish_model
from components.jobs import Job
from components.launch.ranks import actor_ranks
from components.serving.auth import ranks_secret
from components.tracking.provenance import (HELD_OUT_SHAPES_OUTPUT, STAGE_NOT_TRAINED, data_record, job_record,
                                            model_record)
from components.tracking.run import RunSession
from models.config import merge
from models.export import export_spec
from models.loop import DIRECT, Leader, StageSteps, Steps, run_loop
from models.policy import load_policy_tokenizer
from models.resolve import pin
from models.stages.config import StageRun
from models.stages.data import Pairs, Sequences, position_limit
from models.stages.kinds import stage_kind
from models.stages.train import total_steps


class Stage(Job):
    """A stage run (models/stages/config.py: SFTRun, RewardModelRun, DPORun; KTO's); what differs between stages is
    their trainer's (models/stages/: a StageKind)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.trainer = stage_kind(name)

    def prepare(self, cfg: StageRun) -> tuple[StageRun, tuple]:
        """The config with what it reads pinned and its derived values (an absolute state directory, the LR
        schedule's length from the rows it trains on), its training rows and its held-out rows (None without
        eval_split), read with the model's tokenizer: bad data fails here, before any model loads."""
        cfg = pin(cfg)
        data, held_out = stage_rows(cfg)
        updates = {"deploy.state_dir": str(cfg.resolved_state_dir())}
        if cfg.train.optim.total_steps is None:
            updates[f"{cfg.stage}.optim.total_steps"] = total_steps(cfg.train, len(data))
        return merge(cfg, updates), (data, held_out)

    def tags(self, cfg: StageRun) -> dict[str, str]:
        return {"stage": cfg.stage, "model": cfg.model}

    def provenance(self, cfg: StageRun) -> dict:
        """What it trains from: the training fields of its section, its rows (and its held-out rows when its model
        carries what they measure: a reward model's statistics), the model it trains from as pinned."""
        t = cfg.train
        excluded = STAGE_NOT_TRAINED - HELD_OUT_SHAPES_OUTPUT if self.trainer.held_out_in_model else STAGE_NOT_TRAINED
        data = {"train": data_record(cfg.source(f"{cfg.stage}.data"), t.split)}
        if t.eval_split is not None and self.trainer.held_out_in_model:
            data["eval"] = data_record(cfg.source(held_out_field(cfg)), t.eval_split)
        return job_record(cfg, {cfg.stage: t.model_dump(mode="json", exclude=excluded)},
                          {"model": model_record(cfg.source("model"))}, data)

    def run(self, session: RunSession, rows, steps: Steps = DIRECT) -> dict:
        cfg, (data, held_out) = session.cfg, rows
        with actor_ranks(cfg, session.local_dir / "logs", ranks_secret()) as trainee:
            log_data(session, data, held_out, steps)
            steps("restore", session.restore, trainee, "trainee")
            plug = StageSteps(cfg, trainee, data, held_out)
            history, evaluations = run_loop(plug, StageRecord(session, steps, plug.schedule.total), steps)
            added = self.trainer.model_config(trainee, data, evaluations)
        steps.log(f"{self.title(session.name)} finished after {trainee.state.iteration} steps")
        return {"stage": cfg.stage, "steps": trainee.state.iteration, "history": history, "evals": evaluations,
                "metrics": {**(history[-1] if history else {}), **(evaluations[-1] if evaluations else {})},
                **({"model_config": added} if added else {})}

    def publish(self, session: RunSession, result: dict, steps: Steps = DIRECT) -> dict:
        out = publish_model(session, "model", result.get("model_config"), log_model=False)
        steps.log(f"{session.cfg.stage} model: {out['model']}")
        return out


# ---------------------------------------------------------------- data

def stage_rows(cfg: StageRun, model_dir: str | None = None, held_out_only: bool = False):
    """The training rows and the held-out rows (None without eval_split) of a stage's pinned sources, tokenized with
    the tokenizer of its model (`model_dir`: of another model, a pipeline's trained one) and cut to its position
    limit (max_length); `held_out_only`: (None, held-out)."""
    from transformers import AutoConfig  # heavy (~3 s): only a stage's run needs it

    train, path = cfg.train, model_dir or cfg.local_path("model")
    tokenizer = load_policy_tokenizer(path, "model")
    limit = position_limit(tokenizer, train.max_length, AutoConfig.from_pretrained(path))
    load = stage_kind(cfg.stage).load_rows
    data = None if held_out_only else load(cfg.source(f"{cfg.stage}.data"), train.split, tokenizer, limit)
    held_out = None
    if train.eval_split is not None:
        held_out = load(cfg.source(held_out_field(cfg)), train.eval_split, tokenizer, limit)
        if train.max_eval_rows:
            held_out = held_out.head(train.max_eval_rows)
    return data, held_out


def held_out_field(cfg: StageRun) -> str:
    """The field its held-out rows are read from: eval_data, else its data (at eval_split)."""
    return f"{cfg.stage}.eval_data" if cfg.train.eval_data else f"{cfg.stage}.data"


def log_data(session: RunSession, data: Sequences | Pairs, held_out, steps: Steps) -> None:
    counts = {"data/rows": len(data), "data/dropped_rows": data.dropped}
    note = f"data: {len(data)} {'pairs' if isinstance(data, Pairs) else 'rows'} from {data.source}"
    if data.dropped:
        note += f" ({data.dropped} dropped: longer than max_length)"
    if held_out is not None:
        counts["eval/rows"] = len(held_out)
        note += f"; held out: {len(held_out)} from {held_out.source}"
    session.log_data(counts, note, steps.log)


# ---------------------------------------------------------------- the record

@dataclass
class StageRecord:
    """What the training loop records a stage into (models/loop.Record): its MLflow run and checkpoint store."""

    session: RunSession
    steps: Steps
    total: int  # the step it trains to

    def guard(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def log(self, done: list[tuple[int, dict, list[dict]]]) -> None:
        """The steps' metrics in one batch (those an earlier attempt logged skipped), the last one's in the log."""
        self.session.log_steps([(step, metrics) for step, metrics, _ in done])
        step, metrics, _ = done[-1]
        self.steps.log(f"{self.session.cfg.stage} step {step}/{self.total}: "
                       + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("train/")))

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None:
        self.session.log_eval(step, metrics, rows)
        self.steps.log(f"{self.session.cfg.stage} eval at step {step}: "
                       + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/")))

    def checkpoint(self, trainee: Leader) -> str:
        """The trainee (all ranks take part) as the checkpoint's `trainee` part, with how it exports (its task, dtype
        and the base a LoRA adapter merges onto)."""
        session, cfg = self.session, self.session.cfg
        spec = export_spec("trainee", stage_kind(cfg.stage).task, cfg.train.dtype, cfg.source("model"))
        uri = session.checkpoint(trainee, "trainee", {"export": spec})
        self.steps.log(f"checkpoint step {trainee.state.iteration}: {uri}")
        return uri
