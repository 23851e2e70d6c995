"""Serve every deployment from one process (what `rlhf up` starts): `python -m flows.serve`."""

from __future__ import annotations

from prefect import serve

from components.environment import quiet
from flows.compare import compare
from flows.ppo import ppo
from flows.reinforce import reinforce
from flows.servers import critic_server, reward_server, rollout_server
from flows.stages import dpo, pipeline, reward_model, sft
from flows.sweep import EXAMPLE_CONFIG, EXAMPLE_SWEEP, sweep_flow


def deployments():
    return [
        ppo.to_deployment(name="default", parameters={"config": {"algorithm": "ppo"}, "deploy": {}},
                          description="PPO on the embedded default (tiny local models); --param config='{...}' sets any "
                                      "run field, --param deploy='{...}' where its parts run (both merged over these)"),
        reinforce.to_deployment(name="default", parameters={"config": {"algorithm": "rloo"}, "deploy": {}},
                                description="REINFORCE/RLOO on the embedded default (merged as ppo/default's)"),
        critic_server.to_deployment(name="default", description="PyTriton critic server (critic_infer/train/save)"),
        reward_server.to_deployment(name="default", description="PyTriton reward server (reward_model)"),
        rollout_server.to_deployment(name="default", description="vLLM rollout server (generate, update_weights)"),
        compare.to_deployment(name="default", description="PPO vs RLOO curves and table"),
        sft.to_deployment(name="default", parameters={"config": {}, "deploy": {}},
                          description="Supervised fine-tuning on completions (the embedded default: tiny policy, "
                                      "builtin:sentiment_sft); --param config='{...}' merged over these"),
        reward_model.to_deployment(name="default", parameters={"config": {}, "deploy": {}},
                                   description="A Bradley-Terry reward model on preference pairs (the embedded "
                                               "default: builtin:sentiment_preference)"),
        dpo.to_deployment(name="default", parameters={"config": {}, "deploy": {}},
                          description="DPO on preference pairs against the frozen model it starts from (the embedded "
                                      "default: the tiny policy, builtin:sentiment_preference)"),
        pipeline.to_deployment(name="default", parameters={"config": {}, "deploy": {}},
                               description="sft -> reward_model -> rl -> eval (sft -> dpo -> eval with a dpo section) on "
                                           "the embedded default, each stage reused when nothing it was made from "
                                           "changed (Cached)"),
        sweep_flow.to_deployment(name="default", parameters={"config": EXAMPLE_CONFIG.model_dump(mode="json", exclude_unset=True),
                                                              "sweep": EXAMPLE_SWEEP.model_dump(mode="json")},
                                 description="A hyperparameter sweep (Optuna): trials are runs of ppo/default or "
                                             "reinforce/default; the defaults are a 2 x 2 grid of RLOO runs"),
    ]


if __name__ == "__main__":
    quiet()
    serve(*deployments(), limit=4)
