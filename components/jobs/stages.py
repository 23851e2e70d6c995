"""What a stage that trains on the actor's ranks plugs into the job builder (components/runs.py): SFT, a reward model,
DPO (models/stages/train.py and dpo.py say what each trains).

    prepare    its rows read with the model's tokenizer: bad data fails here, before any model loads
    sources    the provenance of the model it trains from (models/resolve.py)
    run        the trainee on the actor's ranks (components/launch/ranks.py), restored from the job's checkpoint; the
               held-out eval before the first step; optimizer steps in segments between checkpoints and evals; the
               eval after the last step
    publish    the last checkpoint's model as a plain HF model directory (components/export.py, the one export: LoRA
               merged onto its digest-checked base, the stage's dtype; a reward model with the reward statistics of
               its held-out eval in its config.json) stored beside the checkpoints with the sha256 of every file
"""

from __future__ import annotations

from components.export import publish_model
from components.launch.ranks import actor_ranks
from components.serving.auth import ranks_secret
from components.tracking.run import RunSession
from models.config import merge
from models.data import RowStream
from models.deploy import DeployConfig
from models.export import export_spec
from models.loop import DIRECT, Steps
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
            history, evaluations = stage_loop(cfg, trainee, data, held_out, session, steps)
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


# ---------------------------------------------------------------- the loop

def stage_loop(cfg: StageRun, trainee, data, held_out, session: RunSession,
               steps: Steps = DIRECT) -> tuple[list[dict], list[dict]]:
    """Train from where the trainee stands to the last step: the held-out eval before the first step (not again at a
    resume point), every eval_every steps and after the last; a checkpoint every checkpoint.every steps and after the
    last. Steps run in segments (one named step each) between checkpoints and evals."""
    train = cfg.train
    total = total_steps(train, len(data))
    stream = RowStream(len(data), train.batch_size, cfg.seed).restored(trainee.state.data, f"{cfg.stage}.data")
    start, history, evaluations = trainee.state.iteration, [], []
    held = held_out.rows(list(range(len(held_out)))) if held_out is not None else None

    def evaluate(step: int) -> None:
        metrics, rows = steps("eval", trainee.evaluate, held)
        steps("log-eval", session.log_eval, step, metrics, eval_table(held_out, rows), retries=2)
        evaluations.append({"step": step, **metrics})
        steps.log(f"{cfg.stage} eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                                     if k.startswith("eval/")))

    def segment(stop: int) -> list[dict]:
        out = []
        while trainee.state.iteration < stop:
            out.append(trainee.train(data.rows(next(stream)), stream.state()))
        session.log_steps([(int(m["step"]), m) for m in out])
        return out

    if held is not None and start == 0:
        evaluate(0)
    while trainee.state.iteration < total:
        steps.progress(trainee.state.iteration, total, "steps")
        i = trainee.state.iteration
        marks = [total, (i // cfg.checkpoint.every + 1) * cfg.checkpoint.every]
        if train.eval_every:
            marks.append((i // train.eval_every + 1) * train.eval_every)
        stop = min(marks)
        done = steps(f"{cfg.stage}-steps", segment, stop)
        history += done
        steps.log(f"{cfg.stage} step {stop}/{total}: " + ", ".join(f"{k} {v:.4f}" for k, v in done[-1].items()
                                                                   if k.startswith("train/")))
        if stop % cfg.checkpoint.every == 0 or stop == total:
            uri = steps("checkpoint", checkpoint, session, trainee)
            steps.log(f"checkpoint step {stop}: {uri}")
        if held is not None and train.eval_every and stop % train.eval_every == 0 and stop != total:
            evaluate(stop)
    if held is not None and start < total:
        evaluate(total)
    steps.progress(total, total, "steps")
    return history, evaluations


def eval_table(held_out, rows: list[dict], limit: int = 32) -> list[dict]:
    """Held-out pairs with their scores (a reward model's, DPO's implicit rewards); SFT has none."""
    if not isinstance(held_out, Pairs) or not rows:
        return []
    return [{"prompt": p, "chosen": c, "rejected": r, **scores}
            for (p, c, r), scores in zip(held_out.texts[:limit], rows[:limit])]


# ---------------------------------------------------------------- the output

def reward_stats(cfg: StageRun, trainee, data, evaluations: list[dict]) -> dict | None:
    """What a reward model's config.json carries beside its weights (`reward.normalize` reads them): reward_mean and
    reward_std of its last held-out eval, else of up to STATS_ROWS training pairs scored now; None for other stages."""
    if cfg.stage != "reward_model":
        return None
    last = evaluations[-1] if evaluations else trainee.evaluate(data.rows(list(range(min(len(data), STATS_ROWS)))))[0]
    return {"reward_mean": last["reward_mean"], "reward_std": last["reward_std"]}


def checkpoint(session: RunSession, trainee) -> str:
    """The trainee (all ranks take part) as the checkpoint's `trainee` part, with how it exports (its task, dtype and
    the base a LoRA adapter merges onto)."""
    cfg = session.cfg
    task = "sequence-classification" if cfg.stage == "reward_model" else "causal-lm"
    spec = export_spec("trainee", task, cfg.train.dtype, cfg.model, cfg.model_revision, "model",
                       session.models.get("model"))
    return session.checkpoint(trainee, "trainee", {"export": spec})
