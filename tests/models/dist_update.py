"""One PPO or RLOO training step (models/step.py) on fixed rollouts, on however many ranks this process group has (run
by tests/models/test_distributed.py: in the test process for 1 rank, under torchrun for 2).

    RLHF_RUN_SECRET=... python -m torch.distributed.run --nproc_per_node 2 tests/models/dist_update.py ALGO CONFIG_JSON
    FIXTURE OUT
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import distributed
from models.algorithms import ALGORITHMS, Backends
from models.backends import LocalCritic, LocalRewardModel
from models.config import RLHFConfig
from models.data import Batch
from models.loop import build_actor, build_critic_trainer, build_local_reward
from models.reward import load_reward_model
from models.engines.base import Rollout
from models.step import train_step


def ranks_env() -> dict[str, str]:
    """The environment of a torchrun of this directory's scripts: this one's, without a rank's variables, with a run
    secret of its own for the ranks to prove (models/rendezvous.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "RLHF_RUN_SECRET": secrets.token_urlsafe(32)}


class Replay:
    """A rollout engine (models/engines/base.RolloutEngine) that hands out this rank's fixed rollouts, one per call
    (dynamic sampling asks once per round)."""

    name, shares_actor_weights = "replay", True

    def __init__(self, rollouts: list[Rollout]):
        self.rollouts = list(rollouts)

    def generate(self, prompt_ids, n, sampling, generator=None) -> Rollout:
        rollout = self.rollouts.pop(0)
        assert len(prompt_ids) * n == len(rollout), (len(prompt_ids), n, len(rollout))
        return rollout

    def update_weights(self, weights) -> None:
        raise AssertionError("a replay engine shares the actor's weights")

    def close(self) -> None:
        pass


def update(cfg: RLHFConfig, fixture: dict, me: distributed.Dist) -> tuple[dict, dict, dict]:
    """(full actor state dict on rank 0, metrics, the weights a rollout engine would receive) after one training
    step of this rank's share of the fixed rollouts. `cfg` is prepared (models/prepare.prepare_run)."""
    state = build_actor(cfg, me)
    algorithm = ALGORITHMS[cfg.algorithm]
    k = algorithm.samples_per_prompt(algorithm.settings(cfg))
    rounds = fixture.get("rounds") or [fixture]  # dynamic sampling: the batch, then the stream's next ones

    def share(part: dict) -> Rollout:
        mine = me.shard(len(part["prompts"]))
        rows = slice(mine.start * k, mine.stop * k)
        return Rollout(*(part[name][rows] for name in ("tokens", "prompt_lengths", "lengths", "is_end",
                                                       "sample_logprobs")))

    state.engine = Replay([share(part) for part in rounds])
    backends = Backends()
    if me.is_leader:
        if algorithm.needs_critic:
            backends.critic = LocalCritic(build_critic_trainer(cfg))
        elif cfg.reward.source == "function":
            backends.reward = build_local_reward(cfg)
        else:
            backends.reward = LocalRewardModel(load_reward_model(cfg.local_path("model.reward")))
    metrics, _ = train_step(state, rounds[0]["prompts"], cfg, backends,
                            reserve=[Batch(part["prompts"]) for part in rounds[1:]])
    for backend in (backends.critic, backends.reward):
        if backend is not None:
            backend.close()
    engine_weights = dict(state.policy.engine_weights())  # every rank iterates: each tensor is gathered
    return distributed.full_state_dict(state.policy.model), metrics, engine_weights


def main() -> None:
    _, config_json, fixture_path, out = sys.argv
    me = distributed.from_env()
    torch.set_num_threads(1)
    distributed.init(me, "gloo", 120, torch.device("cpu"), os.environ["RLHF_RUN_SECRET"])
    cfg = RLHFConfig.model_validate_json(Path(config_json).read_text())
    weights, metrics, engine_weights = update(cfg, torch.load(fixture_path, weights_only=False), me)
    if me.is_leader:
        torch.save({"weights": weights, "metrics": metrics, "engine_weights": engine_weights}, out)
    # Both ranks are done with collectives; leave without the interpreter's teardown, where gloo's threads
    # occasionally abort a rank ("terminate called without an active exception", CI 2026-11-25; pytorch PR 179291)
    # after the result is written. What this test checks is the result, not the exit.
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
