"""One PPO or RLOO update on fixed rollouts, on however many ranks this process group has (run by
tests/models/test_distributed.py: in the test process for 1 rank, under torchrun for 2).

    python -m torch.distributed.run --nproc_per_node 2 tests/models/dist_update.py ALGO CONFIG_JSON FIXTURE OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import distributed  # noqa: E402
from models.actor import Timers  # noqa: E402
from models.backends import LocalCritic, LocalRewardModel  # noqa: E402
from models.config import RLHFConfig  # noqa: E402
from models.loop import build_actor, build_critic_trainer  # noqa: E402
from models.policy import Rollout  # noqa: E402
from models.ppo import ppo_train  # noqa: E402
from models.reward import load_reward_model  # noqa: E402
from models.rloo import rloo_train  # noqa: E402


def update(cfg: RLHFConfig, fixture: dict, me: distributed.Dist) -> tuple[dict, dict]:
    """(full actor state dict on rank 0, metrics) after one update of this rank's share of the fixed rollouts."""
    state = build_actor(cfg, me)
    k = cfg.reinforce.num_rollouts_per_prompt if cfg.algorithm == "rloo" else 1
    prompts = fixture["prompts"]
    mine = me.shard(len(prompts))
    rows = slice(mine.start * k, mine.stop * k)
    rollout = Rollout(*(fixture[name][rows] for name in ("tokens", "prompt_lengths", "lengths", "is_end", "sample_logprobs")))
    local_prompts = [p for p in prompts[mine] for _ in range(k)]
    if cfg.algorithm == "ppo":
        critic = LocalCritic(build_critic_trainer(cfg)) if me.is_leader else None
        metrics, _ = ppo_train(state, rollout, local_prompts, critic, None, cfg, None, Timers(), n_prompts=len(prompts))
        if critic is not None:
            critic.close()
    else:
        reward = LocalRewardModel(load_reward_model(cfg.resolve_model_path(cfg.model.reward))) if me.is_leader else None
        metrics, _ = rloo_train(state, rollout, local_prompts, reward, cfg, None, Timers(), n_rollouts=len(prompts) * k)
    return distributed.full_state_dict(state.policy.model), metrics


def main() -> None:
    _, config_json, fixture_path, out = sys.argv
    me = distributed.from_env()
    torch.set_num_threads(1)
    distributed.init(me, "gloo", 120, torch.device("cpu"))
    cfg = RLHFConfig.model_validate_json(Path(config_json).read_text())
    weights, metrics = update(cfg, torch.load(fixture_path, weights_only=False), me)
    if me.is_leader:
        torch.save({"weights": weights, "metrics": metrics}, out)
    distributed.shutdown(me, graceful=True)


if __name__ == "__main__":
    main()
