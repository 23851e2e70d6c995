"""What an eval plugs into the job builder (components/runs.py): a policy against a reference policy on held-out
prompts, judged by a reward model and a gold reward (models/stages/evaluate.compare_policies), or (`run`: a
pipeline whose RL stage scores with functions or environments) as that RL run's held-out eval judges
(models/eval.judge: its reward functions, its environments' episodes, pass@k), in this process. Either way one
metric scheme (models/eval.compared): the policy's as an RL run's held-out eval names them, the reference's as
eval/reference/<name>, the win rates and the gain in success of their paired samples.

    prepare    what it reads pinned (models/resolve.py), the held-out prompts read with the policy's tokenizer: bad
               data fails here, before any model loads
    provenance its record: the comparison's settings, the held-out prompts' rows, the policies and the judge as
               pinned, the gold reward's file (and the judging RL run's settings, reward and environment files)
    run        both policies sample, the judge scores; the metrics at step 0 and the sample table in MLflow
    publish    nothing: an eval trains no model (its kind publishes none)
"""

from __future__ import annotations

from components.jobs import Job
from components.tracking.provenance import (EVAL_NOT_MEASURED, RL_NOT_TRAINED, data_record, function_record,
                                            job_record, judging_files, model_record)
from components.tracking.run import RunSession
from models.algorithms import Backends
from models.backends import FunctionReward
from models.config import RLHFConfig, Sampling, merge
from models.data import PromptSet, load_prompt_set
from models.distributed import SINGLE, local_device
from models.eval import compared, judge
from models.loop import DIRECT, Steps, build_actor, checked_prompt_set, gold_function
from models.policy import load_policy_tokenizer
from models.prepare import prepare_run
from models.resolve import pin
from models.reward import load_reward_functions
from models.stages.config import EvalRun
from models.stages.evaluate import compare_policies


class Eval(Job):
    """An eval run (models/stages/config.EvalRun)."""

    def __init__(self):
        super().__init__(EvalRun.job)

    def prepare(self, cfg: EvalRun) -> tuple[EvalRun, PromptSet]:
        e = cfg.eval
        cfg = pin(cfg)  # every model and the prompts are here, a missing one named by its field, before any loads
        tokenizer = load_policy_tokenizer(cfg.local_path("model"))
        if cfg.run is not None:  # read as the RL run's eval reads them (its chat template, its functions' columns)
            prompts = checked_prompt_set(as_run(cfg, "model"), tokenizer, cfg.source("eval.prompts"), e.split,
                                         e.prompt_key)
        else:
            prompts = load_prompt_set(cfg.source("eval.prompts"), e.split, e.prompt_key, tokenizer)
        return cfg, prompts.head(e.max_prompts) if e.max_prompts else prompts

    def tags(self, cfg: EvalRun) -> dict[str, str]:
        return {"stage": "eval", "model": cfg.model, "reference": cfg.reference,
                "reward": cfg.reward if cfg.run is None else "run"}

    def provenance(self, cfg: EvalRun) -> dict:
        """What it measures with: the comparison's settings (and the judging RL run's training fields), the held-out
        prompts' rows, the policies and the judge as pinned, the gold reward's file (and the judging run's reward
        and environment files)."""
        e = cfg.eval
        config = {"eval": e.model_dump(mode="json", exclude=EVAL_NOT_MEASURED)}
        if cfg.run is not None:
            config["run"] = cfg.run.model_dump(mode="json", exclude=RL_NOT_TRAINED)
        models = {"policy": model_record(cfg.source("model")), "reference": model_record(cfg.source("reference"))}
        if cfg.reward:
            models["reward"] = model_record(cfg.source("reward"))
        files = {"gold": function_record(e.gold, "eval.gold")} if e.gold else {}
        if cfg.run is not None:  # judged as an RL run's eval: its reward functions and environments, by content
            files.update(judging_files(cfg.run))
        return job_record(cfg, config, models, {"prompts": data_record(cfg.source("eval.prompts"), e.split)}, files)

    def run(self, session: RunSession, prompts: PromptSet, steps: Steps = DIRECT) -> dict:
        cfg, e = session.cfg, session.cfg.eval
        if cfg.run is not None:
            metrics, rows = steps("evaluate-policies", evaluate_as_run, cfg, prompts)
        else:
            sampling = Sampling(max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k,
                                top_p=e.top_p)
            paths = [cfg.local_path(name) for name in ("model", "reference", "reward")]
            metrics, rows = steps("compare-policies", compare_policies, *paths, prompts,
                                  sampling, e.samples_per_prompt, e.gold, cfg.seed, e.table_rows, e.normalize,
                                  local_device(cfg.deploy.device, SINGLE), e.success_threshold)
        session.log_eval(0, metrics, rows)
        steps.log("eval: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return {"steps": 0, "history": [], "evals": [{"step": 0, **metrics}], "metrics": metrics, "rows": rows}


def as_run(cfg: EvalRun, side: str) -> RLHFConfig:
    """The RL run config whose held-out eval evaluates the policy of `side` ('model' or 'reference') as the eval asks
    (its prompts, samples, temperature, lengths, success threshold, gold), sampled in this process (the native
    engine); it carries the eval's pins, so preparing it resolves nothing again (models/resolve.pin)."""
    e = cfg.eval
    run = RLHFConfig.of(merge(cfg.run, {
        "model.policy": getattr(cfg, side), "model.revision": None, "model.reward": None, "model.critic": None,
        "rollout.engine": "native", "rollout.max_off_policy_steps": 0, "seed": cfg.seed,
        "data.prompts": cfg.run.data.prompts or e.prompts,
        "eval.prompts": e.prompts, "eval.subset": e.subset, "eval.revision": e.revision, "eval.options": None,
        "eval.every": 1, "eval.samples_per_prompt": e.samples_per_prompt, "eval.table_rows": e.table_rows,
        "eval.temperature": e.temperature, "eval.success_threshold": e.success_threshold, "reward.gold": e.gold,
        "generation.max_new_tokens": e.max_new_tokens, "generation.top_k": e.top_k, "generation.top_p": e.top_p}),
        cfg.deploy)
    return pin(run.model_copy(update={"sources": cfg.sources}))


def evaluate_as_run(cfg: EvalRun, prompts: PromptSet) -> tuple[dict, list[dict]]:
    """Both policies through the RL run's held-out eval (models/eval.judge: its reward functions, or its
    environments' episodes, one sampling seed for both), compared (models/eval.compared)."""
    sides = {}
    for side in ("model", "reference"):
        run = prepare_run(as_run(cfg, side))
        state = build_actor(run)
        try:
            reward = None if run.environment.enabled else FunctionReward(load_reward_functions(run.reward,
                                                                                               deploy=run.deploy))
            sides[side] = judge(state, prompts.all(), run, Backends(reward=reward), gold_function(run), 0)
        finally:
            state.close()
    return compared(sides["model"], sides["reference"], cfg.eval.table_rows)
