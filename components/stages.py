"""The run builder of the stages before RL: a supervised fine-tuning or reward-model run composed from its config, for
`rlhf sft`, `rlhf reward-model`, their flows and a pipeline's stages alike (components/runs.py is the RL stage's).

    read its data with the model's tokenizer: bad data fails here, before any model loads
    open or resume its record: the MLflow run and the checkpoint store (re-running a name resumes its last checkpoint)
    start the trainee on the actor's ranks (components/launch/ranks.py), restored from that checkpoint
    the held-out eval before the first step; optimizer steps in segments between checkpoints and evals; the eval after
        the last step
    the output: the last checkpoint's model as a plain HF model directory (components/export.py, the one export:
        LoRA merged onto its digest-checked base, the stage's dtype; a reward model with the reward statistics of its
        held-out eval in its config.json) stored beside the checkpoints with the sha256 of every file

How each named step executes is the caller's `Steps` (models/loop.py): directly (`rlhf sft`), or as Prefect tasks of
a flow run (components/tasks.FlowSteps). Where the ranks run is the config's `deploy` section.
"""

from __future__ import annotations

import secrets
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from components.export import export_checkpoint
from components.launch.ranks import actor_ranks
from components.storage.store import CheckpointStore
from components.tracking.run import checkpoint_uri, closed_when_done, default_tracking_uri
from components.tracking.tracker import Tracker
from models.config import merge
from models.export import export_spec
from models.data import RowStream
from models.deploy import DeployConfig
from models.loop import DIRECT, Steps
from models.stages.config import StageRun
from models.policy import load_policy_tokenizer
from models.stages.data import Pairs, Sequences, load_pairs, load_sequences, position_limit
from models.stages.train import total_steps
from models.resolve import file_digests
from models.tiny_files import manifest_digest

STATS_ROWS = 1000  # pairs whose rewards give the reward statistics when a reward model has no held-out split


def train_stage(cfg: StageRun, steps: Steps = DIRECT) -> dict:
    """Run (or resume, by run name) the stage run of `cfg` to its last step; returns its summary: run name, MLflow run
    id, the output model (its URI in the store, the local directory, the sha256 of every file), the last held-out
    eval's metrics, and the steps this attempt ran."""
    cfg, data, held_out = prepare_stage(cfg)  # bad data fails here, before any model loads
    with stage_session(cfg, steps) as session, actor_ranks(cfg, session.local_dir / "logs", cfg.stage) as trainee:
        session.log_data(data, held_out, steps)
        steps("restore", session.restore, trainee)
        history, evaluations = stage_loop(cfg, trainee, data, held_out, session, steps)
        output = steps("export-model", publish, session, trainee, data, evaluations, steps)
        steps.log(f"{cfg.stage} run {session.name} finished after {trainee.state.iteration} steps: model {output['model']}")
        return {"stage": cfg.stage, "run_name": session.name, "mlflow_run_id": session.tracker.run_id,
                **output, "metrics": {**(history[-1] if history else {}), **(evaluations[-1] if evaluations else {})},
                "history": history, "evals": evaluations, "steps": trainee.state.iteration}


# ---------------------------------------------------------------- data

def prepare_stage(cfg: StageRun) -> tuple[StageRun, Sequences | Pairs, Sequences | Pairs | None]:
    """The config with its derived values (its model exists, an absolute state directory, the LR schedule's length
    from the rows it trains on), its training rows and its held-out rows (None without eval_split), read with the
    model's tokenizer: bad data fails here, before any model loads."""
    path = cfg.resolve_model_path(cfg.model)
    data, held_out = stage_rows(cfg.stage, cfg.train, path, deploy=cfg.deploy)
    updates = {"deploy.state_dir": str(cfg.resolved_state_dir())}
    if cfg.train.optim.total_steps is None:
        updates[f"{cfg.stage}.optim.total_steps"] = total_steps(cfg.train, len(data))
    return merge(cfg, updates), data, held_out


def stage_rows(stage: str, train, path: str, held_out_only: bool = False, deploy: DeployConfig | None = None):
    """The training rows and the held-out rows (None without eval_split) of a stage's section (at its subset and
    revision), tokenized with the tokenizer of the model at `path` and cut to its position limit (max_length);
    `held_out_only`: (None, held-out)."""
    from transformers import AutoConfig  # heavy (~3 s): only a stage's run needs it

    tokenizer = load_policy_tokenizer(path, "model")
    limit = position_limit(tokenizer, train.max_length, AutoConfig.from_pretrained(path))
    load = load_sequences if stage == "sft" else load_pairs
    field_name = f"{stage}.data"
    data = None if held_out_only else load(train.data, train.split, tokenizer, limit, field_name, train.subset,
                                           train.revision, deploy)
    held_out = None
    if train.eval_split is not None:
        held_out = load(train.eval_data or train.data, train.eval_split, tokenizer, limit,
                        f"{stage}.eval_data" if train.eval_data else field_name, train.subset, train.revision, deploy)
        if train.max_eval_rows:
            held_out = _head(held_out, train.max_eval_rows)
    return data, held_out


def _head(rows, n: int):
    if isinstance(rows, Sequences):
        return Sequences(rows.ids[:n], rows.prompt_lengths[:n], rows.source, rows.dropped, rows.truncated, rows.mismatched)
    return Pairs(rows.chosen[:n], rows.rejected[:n], rows.margin[:n] if rows.margin is not None else None, rows.source,
                 rows.texts[:n], rows.dropped, rows.mismatched)


def all_rows(rows) -> dict:
    return rows.rows(list(range(len(rows))))


# ---------------------------------------------------------------- the record: MLflow run and checkpoint store

def stage_run_name(cfg: StageRun) -> str:
    return cfg.run_name or f"{cfg.stage.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@dataclass
class StageSession:
    """A stage run's durable state: its name, local directory, checkpoint store, MLflow run, resume manifest."""

    cfg: StageRun
    name: str
    local_dir: Path
    store: CheckpointStore
    tracker: Tracker
    resumed_from: int | None = None
    manifest: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # the provenance of the model it trains from (models/resolve.py)

    @classmethod
    def open(cls, cfg: StageRun, tags: dict[str, str] | None = None) -> "StageSession":
        name = stage_run_name(cfg)
        local_dir = cfg.resolved_state_dir() / "runs" / name
        local_dir.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore.from_uri(checkpoint_uri(cfg, name), s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
        manifest, resumed_from = {}, store.latest()
        if resumed_from is not None:
            shutil.rmtree(local_dir / "restore", ignore_errors=True)
            manifest = store.load(local_dir / "restore", resumed_from)
        nested = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
        model = cfg.resolve_model(cfg.model).provenance
        tracker = Tracker(default_tracking_uri(cfg), cfg.tracking.experiment, name, run_id=manifest.get("tracking_run_id"),
                          tags={"stage": cfg.stage, "model": cfg.model, "model.digest": model["digest"],
                                **({"model.commit": model["commit"]} if model.get("commit") else {}),
                                **nested, **(tags or {})},
                          system_metrics=cfg.deploy.tracking.system_metrics)
        tracker.start(cfg.model_dump(mode="json"))
        return cls(cfg, name, local_dir, store, tracker, resumed_from, manifest, model)

    def restore(self, trainee) -> str | None:
        """Load the downloaded checkpoint into the freshly built trainee on all its ranks."""
        return trainee.restore(self.local_dir / "restore" / "trainee") if self.resumed_from is not None else None

    def save(self, trainee) -> str:
        """Checkpoint the trainee (all ranks take part) and the manifest; prune; record in MLflow."""
        stage = self.local_dir / "staging"
        shutil.rmtree(stage, ignore_errors=True)
        trainee.save(stage / "trainee")
        state = trainee.state
        cfg = self.cfg
        manifest = {"iteration": state.iteration, "episode": state.episode, "run_name": self.name,
                    "world_size": state.me.world_size, "tracking_run_id": self.tracker.run_id,
                    "config": cfg.model_dump(mode="json"), "models": {"model": self.model},
                    "export": export_spec("trainee", "causal-lm" if cfg.stage == "sft" else "sequence-classification",
                                          cfg.train.dtype, cfg.model, cfg.model_revision, "model", self.model)}
        uri = self.store.save(state.iteration, {"trainee": stage / "trainee"}, manifest)
        self.store.prune(self.cfg.checkpoint.keep_last)
        self.tracker.log_checkpoint(uri, state.iteration)
        shutil.rmtree(stage, ignore_errors=True)
        return uri

    def log(self, steps: list[tuple[int, dict]]) -> None:
        """The metrics of a segment's steps, in one batch; steps an earlier attempt logged (before a resume) are
        skipped."""
        last = self.tracker.last_step
        self.tracker.log_steps([(step, m) for step, m in steps if last is None or step > last])

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None:
        self.tracker.log_side_metrics(metrics, step=step)
        if rows:
            self.tracker.log_table(rows, step=step, name="eval")

    def log_data(self, data, held_out, steps: Steps) -> None:
        counts = {"data/rows": len(data), "data/dropped_rows": data.dropped}
        note = f"data: {len(data)} {'rows' if self.cfg.stage == 'sft' else 'pairs'} from {data.source}"
        if data.dropped:
            note += f" ({data.dropped} dropped: longer than max_length)"
        if held_out is not None:
            counts["eval/rows"] = len(held_out)
            note += f"; held out: {len(held_out)} from {held_out.source}"
        self.tracker.log_side_metrics(counts, step=0)
        steps.log(note)

    def close(self, status: str) -> None:
        self.tracker.end(status)


@contextmanager
def stage_session(cfg: StageRun, steps: Steps = DIRECT) -> Iterator[StageSession]:
    session = steps("open-run", StageSession.open, cfg, steps.tags(), retries=2)
    if session.resumed_from is not None:
        steps.log(f"{cfg.stage} run {session.name}: resuming from checkpoint step {session.resumed_from} "
                  f"({session.store.uri})")
    else:
        steps.log(f"{cfg.stage} run {session.name}: new run from {cfg.model}, checkpoints in {session.store.uri}")
    with closed_when_done(session):
        yield session


# ---------------------------------------------------------------- the loop

def stage_loop(cfg: StageRun, trainee, data, held_out, session: StageSession,
               steps: Steps = DIRECT) -> tuple[list[dict], list[dict]]:
    """Train from where the trainee stands to the last step: the held-out eval before the first step (not again at a
    resume point), every eval_every steps and after the last; a checkpoint every checkpoint.every steps and after the
    last. Steps run in segments (one named step each) between checkpoints and evals."""
    train = cfg.train
    total = total_steps(train, len(data))
    stream = RowStream(len(data), train.batch_size, cfg.seed).restored(trainee.state.data, f"{cfg.stage}.data")
    start, history, evaluations = trainee.state.iteration, [], []
    held = all_rows(held_out) if held_out is not None else None

    def evaluate(step: int) -> None:
        metrics, rows = steps("eval", trainee.evaluate, held)
        table = _eval_table(cfg, held_out, rows)
        steps("log-eval", session.log_eval, step, metrics, table, retries=2)
        evaluations.append({"step": step, **metrics})
        steps.log(f"{cfg.stage} eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                                     if k.startswith("eval/")))

    def segment(stop: int) -> list[dict]:
        out = []
        while trainee.state.iteration < stop:
            out.append(trainee.train(data.rows(next(stream)), stream.state()))
        session.log([(int(m["step"]), m) for m in out])
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
        last = done[-1]
        steps.log(f"{cfg.stage} step {stop}/{total}: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items()
                                                                   if k.startswith("train/")))
        if stop % cfg.checkpoint.every == 0 or stop == total:
            uri = steps("checkpoint", session.save, trainee)
            steps.log(f"checkpoint step {stop}: {uri}")
        if held is not None and train.eval_every and stop % train.eval_every == 0 and stop != total:
            evaluate(stop)
    if held is not None and start < total:
        evaluate(total)
    steps.progress(total, total, "steps")
    return history, evaluations


def _eval_table(cfg: StageRun, held_out, rows: list[dict], limit: int = 32) -> list[dict]:
    """Held-out pairs with their scores (reward model); SFT has none."""
    if cfg.stage != "reward_model" or not rows:
        return []
    return [{"prompt": p, "chosen": c, "rejected": r, **scores}
            for (p, c, r), scores in zip(held_out.texts[:limit], rows[:limit])]


# ---------------------------------------------------------------- the output

def publish(session: StageSession, trainee, data, evaluations: list[dict], steps: Steps = DIRECT) -> dict:
    """Export the stage's model from its last checkpoint (components/export.py: LoRA merged; a reward model with
    reward_mean / reward_std in its config.json: those of its last held-out eval, else of up to STATS_ROWS training
    pairs) and store it beside the checkpoints, each file's sha256 recorded; returns its URI, local directory and
    digests."""
    local = session.local_dir / "model"
    shutil.rmtree(local, ignore_errors=True)
    config = None
    if session.cfg.stage == "reward_model":
        last = evaluations[-1] if evaluations else trainee.evaluate(data.rows(list(range(min(len(data), STATS_ROWS)))))[0]
        config = {"reward_mean": last["reward_mean"], "reward_std": last["reward_std"]}
    export_checkpoint(session.store, local, deploy=session.cfg.deploy, config=config)
    uri = session.store.put_dir(local, "model")
    digests = file_digests(local)
    session.tracker.client.set_tag(session.tracker.run_id, "model.uri", uri)
    return {"model": uri, "model_dir": str(local), "files": digests, "digest": manifest_digest(digests),
            **({"reward_stats": config} if config else {})}


