"""What an eval plugs into the job builder (components/runs.py): a policy against a reference policy on held-out
prompts, judged by a reward model and a gold reward (models/stages/evaluate.compare_policies), or (`run`: a
pipeline whose RL stage scores with functions or environments) as that RL run's held-out eval judges
(models/eval.judge: its reward functions, its environments' episodes, pass@k), in this process. Either way one
metric scheme (models/eval.compared): the policy's as an RL run's held-out eval names them, the reference's as
eval/reference/<name>, the win rates and the gain in success of their paired samples.

    prepare    the held-out prompts read with the policy's tokenizer: bad data fails here, before any model loads
    run        both policies sample, the judge scores; the metrics at step 0 and the sample table in MLflow
    publish    nothing: an eval trains no model
"""

from __future__ import annotations

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
from models.resolve import resolve_data
from models.reward import load_reward_functions
from models.stages.config import EvalRun
from models.stages.evaluate import compare_policies


class Eval:
    """An eval run (models/stages/config.EvalRun)."""

    name = "eval"
    publishes = False

    def prepare(self, cfg: EvalRun) -> tuple[EvalRun, PromptSet]:
        e = cfg.eval
        for name in judged_models(cfg):  # every model is here, named by its field, before any loads
            cfg.resolve_model(getattr(cfg, name), name)
        tokenizer = load_policy_tokenizer(cfg.resolve_model_path(cfg.model))
        if cfg.run is not None:  # read as the RL run's eval reads them (its chat template, its functions' columns)
            prompts = checked_prompt_set(as_run(cfg, cfg.model), tokenizer, e.prompts, e.split, e.prompt_key,
                                         "eval.prompts", e.subset, e.revision)
        else:
            prompts = load_prompt_set(e.prompts, e.split, e.prompt_key, tokenizer, field="eval.prompts",
                                      subset=e.subset, revision=e.revision, deploy=cfg.deploy)
        return cfg, prompts.head(e.max_prompts) if e.max_prompts else prompts

    def tags(self, cfg: EvalRun) -> dict[str, str]:
        return {"stage": "eval", "model": cfg.model, "reference": cfg.reference,
                "reward": cfg.reward if cfg.run is None else "run"}

    def sources(self, cfg: EvalRun, store) -> tuple[EvalRun, dict, dict, dict]:
        """The provenance of the policies, the judge and the held-out prompts (models/resolve.py)."""
        models = {name: cfg.resolve_model(getattr(cfg, name), name).provenance for name in judged_models(cfg)}
        e = cfg.eval
        return cfg, models, {"eval.prompts": resolve_data(e.prompts, "eval.prompts", e.revision, cfg.deploy, e.subset)
                             .provenance}, {}

    def restore_parts(self, cfg: EvalRun) -> None:
        return None

    def opened(self, session: RunSession) -> None:
        pass

    def run(self, session: RunSession, prompts: PromptSet, steps: Steps = DIRECT) -> dict:
        cfg, e = session.cfg, session.cfg.eval
        if cfg.run is not None:
            metrics, rows = steps("evaluate-policies", evaluate_as_run, cfg, prompts)
        else:
            sampling = Sampling(max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k, top_p=e.top_p)
            paths = [cfg.resolve_model(getattr(cfg, name), name).path for name in ("model", "reference", "reward")]
            metrics, rows = steps("compare-policies", compare_policies, *paths, prompts,
                                  sampling, e.samples_per_prompt, e.gold, cfg.seed, e.table_rows, e.normalize,
                                  local_device(cfg.deploy.device, SINGLE), e.success_threshold)
        session.log_eval(0, metrics, rows)
        steps.log("eval: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return {"steps": 0, "history": [], "evals": [{"step": 0, **metrics}], "metrics": metrics, "rows": rows}


def judged_models(cfg: EvalRun) -> tuple[str, ...]:
    return ("model", "reference") if cfg.run is not None else ("model", "reference", "reward")


def as_run(cfg: EvalRun, policy: str) -> RLHFConfig:
    """The RL run config whose held-out eval evaluates `policy` as the eval asks (its prompts, samples, temperature,
    lengths, success threshold, gold), sampled in this process (the native engine)."""
    e = cfg.eval
    return RLHFConfig.of(merge(cfg.run, {
        "model.policy": policy, "model.reward": None, "model.critic": None, "rollout.engine": "native",
        "rollout.max_off_policy_steps": 0, "seed": cfg.seed, "data.prompts": cfg.run.data.prompts or e.prompts,
        "eval.prompts": e.prompts, "eval.every": 1, "eval.samples_per_prompt": e.samples_per_prompt,
        "eval.table_rows": e.table_rows,
        "eval.temperature": e.temperature, "eval.success_threshold": e.success_threshold, "reward.gold": e.gold,
        "generation.max_new_tokens": e.max_new_tokens, "generation.top_k": e.top_k, "generation.top_p": e.top_p}),
        cfg.deploy)


def evaluate_as_run(cfg: EvalRun, prompts: PromptSet) -> tuple[dict, list[dict]]:
    """Both policies through the RL run's held-out eval (models/eval.judge: its reward functions, or its
    environments' episodes, one sampling seed for both), compared (models/eval.compared)."""
    sides = {}
    for side in ("model", "reference"):
        run = prepare_run(as_run(cfg, cfg.resolve_model_path(getattr(cfg, side))))
        state = build_actor(run)
        try:
            reward = None if run.environment.enabled else FunctionReward(load_reward_functions(run.reward, deploy=run.deploy))
            sides[side] = judge(state, prompts.all(), run, Backends(reward=reward), gold_function(run), 0)
        finally:
            state.close()
    return compared(sides["model"], sides["reference"], cfg.eval.table_rows)
