"""What an eval plugs into the job builder (components/runs.py): a policy against a reference policy on held-out
prompts, judged by a reward model and a gold reward (models/stages/evaluate.compare_policies), in this process.

    prepare    the held-out prompts read with the policy's tokenizer: bad data fails here, before any model loads
    run        both policies sample, the judge scores; the metrics at step 0 and the sample table in MLflow
    publish    nothing: an eval trains no model
"""

from __future__ import annotations

from components.tracking.run import RunSession
from models.config import Sampling
from models.data import PromptSet, load_prompt_set
from models.distributed import SINGLE, local_device
from models.resolve import resolve_data
from models.loop import DIRECT, Steps
from models.policy import load_policy_tokenizer
from models.stages.config import EvalRun
from models.stages.evaluate import compare_policies


class Eval:
    """An eval run (models/stages/config.EvalRun)."""

    name = "eval"
    publishes = False

    def prepare(self, cfg: EvalRun) -> tuple[EvalRun, PromptSet]:
        e = cfg.eval
        for name in ("model", "reference", "reward"):  # every model is here, named by its field, before any loads
            cfg.resolve_model(getattr(cfg, name), name)
        prompts = load_prompt_set(e.prompts, e.split, e.prompt_key, load_policy_tokenizer(cfg.resolve_model_path(cfg.model)),
                                  field="eval.prompts", subset=e.subset, revision=e.revision, deploy=cfg.deploy)
        return cfg, prompts.head(e.max_prompts) if e.max_prompts else prompts

    def tags(self, cfg: EvalRun) -> dict[str, str]:
        return {"stage": "eval", "model": cfg.model, "reference": cfg.reference, "reward": cfg.reward}

    def sources(self, cfg: EvalRun, store) -> tuple[EvalRun, dict, dict, dict]:
        """The provenance of the policies, the judge and the held-out prompts (models/resolve.py)."""
        models = {name: cfg.resolve_model(getattr(cfg, name), name).provenance for name in ("model", "reference", "reward")}
        e = cfg.eval
        return cfg, models, {"eval.prompts": resolve_data(e.prompts, "eval.prompts", e.revision, cfg.deploy, e.subset)
                             .provenance}, {}

    def restore_parts(self, cfg: EvalRun) -> None:
        return None

    def opened(self, session: RunSession) -> None:
        pass

    def run(self, session: RunSession, prompts: PromptSet, steps: Steps = DIRECT) -> dict:
        cfg, e = session.cfg, session.cfg.eval
        sampling = Sampling(max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k, top_p=e.top_p)
        paths = [cfg.resolve_model(getattr(cfg, name), name).path for name in ("model", "reference", "reward")]
        metrics, rows = steps("compare-policies", compare_policies, *paths, prompts,
                              sampling, e.samples_per_prompt, e.gold, cfg.seed, e.table_rows, e.normalize,
                              local_device(cfg.deploy.device, SINGLE), e.success_threshold)
        session.log_eval(0, metrics, rows)
        steps.log("eval: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        return {"steps": 0, "history": [], "evals": [{"step": 0, **metrics}], "metrics": metrics, "rows": rows}
