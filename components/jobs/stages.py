"""What a stage that trains on the actor's ranks plugs into the job builder (components/runs.py): SFT, a reward model,
DPO, KTO (models/stages/train.py, dpo.py and kto.py say what each trains).

    prepare    its rows read with the model's tokenizer: bad data fails here, before any model loads
    sources    the provenance of the model it trains from (models/resolve.py)
    run        the trainee on the actor's ranks (components/launch/ranks.py), restored from the job's checkpoint;
               the one training loop (models/loop.run_loop: the stage's `StageSteps`, recorded by `StageRecord`): the
               held-out eval before the first step, optimizer steps in segments between checkpoints and evals, the
               eval after the last step
    publish    the last checkpoint's model as a plain HF model directory (components/export.py, the one export: LoRA
               merged onto its digest-checked base, the stage's dtype; a reward model with the reward statistics of
               its held-out eval in its config.json) stored beside the checkpoints with the sha256 of every file
"""

from __future__ import annotations

from dataclasses import dataclass

from components.export import publish_model
from components.launch.ranks import actor_ranks
from components.serving.auth import ranks_secret
from components.tracking.run import RunSession
from models.config import merge
from models.deploy import DeployConfig
from models.export import export_spec
from models.loop import DIRECT, Leader, StageSteps, Steps, run_loop
from models.policy import load_policy_tokenizer
from models.stages.config import StageRun
from models.stages.data import Pairs, Sequences, position_limit
from models.stages.kinds import stage_kind
from models.stages.train import total_steps

STATS_ROWS = 1000  # pairs whose rewards give the reward statistics when a reward model has no held-out split


class Stage:
    """A stage run (models/stages/config.py: SFTRun, RewardModelRun, DPORun)."""

    def __init__(self, name: str):
        self.name = name

    def prepare(self, cfg: StageRun) -> tuple[StageRun, tuple]:
        """The config with its derived values (an absolute state directory, the LR schedule's length from the rows it
        trains on), its training rows and its held-out rows (None without eval_split), read with the model's
        tokenizer: bad data fails here, before any model loads."""
        data, held_out = stage_rows(cfg.stage, cfg.train, cfg.resolve_model_path(cfg.model), deploy=cfg.deploy)
        updates = {"deploy.state_dir": str(cfg.resolved_state_dir())}
        if cfg.train.optim.total_steps is None:
            updates[f"{cfg.stage}.optim.total_steps"] = total_steps(cfg.train, len(data))
        return merge(cfg, updates), (data, held_out)

    def tags(self, cfg: StageRun) -> dict[str, str]:
        return {"stage": cfg.stage, "model": cfg.model}

    def sources(self, cfg: StageRun, store) -> tuple[StageRun, dict, dict, dict]:
        """The provenance of the model it trains from."""
        return cfg, {"model": cfg.resolve_model(cfg.model).provenance}, {}, {}

    def restore_parts(self, cfg: StageRun) -> None:
        return None

    def opened(self, session: RunSession) -> None:
        pass

    def run(self, session: RunSession, rows, steps: Steps = DIRECT) -> dict:
        cfg, (data, held_out) = session.cfg, rows
        with actor_ranks(cfg, session.local_dir / "logs", ranks_secret()) as trainee:
            log_data(session, data, held_out, steps)
            steps("restore", session.restore, trainee, "trainee")
            plug = StageSteps(cfg, trainee, data, held_out)
            history, evaluations = run_loop(plug, StageRecord(session, steps, plug.schedule.total), steps)
            stats = reward_stats(cfg, trainee, data, evaluations)
        steps.log(f"{cfg.stage} run {session.name} finished after {trainee.state.iteration} steps")
        return {"stage": cfg.stage, "steps": trainee.state.iteration, "history": history, "evals": evaluations,
                "metrics": {**(history[-1] if history else {}), **(evaluations[-1] if evaluations else {})},
                **({"reward_stats": stats} if stats else {})}

    def publish(self, session: RunSession, result: dict, steps: Steps = DIRECT) -> dict:
        out = publish_model(session, result.get("reward_stats"), log_model=False)
        steps.log(f"{session.cfg.stage} model: {out['model']}")
        return out


# ---------------------------------------------------------------- data

def stage_rows(stage: str, train, path: str, held_out_only: bool = False, deploy: DeployConfig | None = None):
    """The training rows and the held-out rows (None without eval_split) of a stage's section (at its subset and
    revision), tokenized with the tokenizer of the model at `path` and cut to its position limit (max_length);
    `held_out_only`: (None, held-out)."""
    from transformers import AutoConfig  # heavy (~3 s): only a stage's run needs it

    tokenizer = load_policy_tokenizer(path, "model")
    limit = position_limit(tokenizer, train.max_length, AutoConfig.from_pretrained(path))
    load = stage_kind(stage).load_rows
    field_name = f"{stage}.data"
    data = None if held_out_only else load(train.data, train.split, tokenizer, limit, field_name, train.subset,
                                           train.revision, deploy)
    held_out = None
    if train.eval_split is not None:
        held_out = load(train.eval_data or train.data, train.eval_split, tokenizer, limit,
                        f"{stage}.eval_data" if train.eval_data else field_name, train.subset, train.revision, deploy)
        if train.max_eval_rows:
            held_out = held_out.head(train.max_eval_rows)
    return data, held_out


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
        task = "sequence-classification" if cfg.stage == "reward_model" else "causal-lm"
        spec = export_spec("trainee", task, cfg.train.dtype, cfg.model, cfg.model_revision, "model",
                           session.models.get("model"))
        uri = session.checkpoint(trainee, "trainee", {"export": spec})
        self.steps.log(f"checkpoint step {trainee.state.iteration}: {uri}")
        return uri


# ---------------------------------------------------------------- the output

def reward_stats(cfg: StageRun, trainee, data, evaluations: list[dict]) -> dict | None:
    """What a reward model's config.json carries beside its weights (`reward.normalize` reads them): reward_mean and
    reward_std of its last held-out eval, else of up to STATS_ROWS training pairs scored now; None for other stages."""
    if cfg.stage != "reward_model":
        return None
    last = evaluations[-1] if evaluations else trainee.evaluate(data.rows(list(range(min(len(data), STATS_ROWS)))))[0]
    return {"reward_mean": last["reward_mean"], "reward_std": last["reward_std"]}

