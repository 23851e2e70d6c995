"""What PPO and REINFORCE share: actor state, phase timers, rollout + logprobs, the minibatch update loop, metrics."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from models.advantages import AdaptiveKLController, FixedKLController
from models.config import KLConfig, OptimConfig, RLHFConfig, RolloutConfig
from models.distributed import SINGLE, Dist
from models.loading import make_optimizer
from models.policy import Policy
from models.engines import RolloutEngine, build_engine
from models.engines.base import Rollout
from models.update import micro_batches, minibatch_update


@dataclass
class ActorState:
    """Everything about this rank's actor that a checkpoint must restore."""

    policy: Policy
    engine: RolloutEngine  # samples the rollouts (models/engines/)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: AdaptiveKLController
    generator: torch.Generator  # sampling: its own stream per rank, from (seed, rank)
    shuffle: torch.Generator  # minibatch order: the same stream on every rank
    me: Dist = SINGLE
    iteration: int = 0
    episode: int = 0  # rollouts consumed so far (all ranks)
    data: dict | None = None  # where the prompt stream stands after the last step (models/data.PromptStream.state)
    episodes: object = None  # an environment run's environments on this rank (models/environments/episodes.py)

    @classmethod
    def create(cls, policy: Policy, optim: OptimConfig, kl: KLConfig, seed: int, me: Dist = SINGLE,
               rollout: RolloutConfig | None = None) -> "ActorState":
        optimizer, scheduler = make_optimizer(policy.trainable_parameters(), optim)
        beta = kl.beta if kl.beta is not None else 0.0  # build_actor passes the recipe's resolved value
        kl_ctl = AdaptiveKLController(beta, kl.target, kl.horizon) if kl.adaptive else FixedKLController(beta)
        sampling = torch.Generator().manual_seed(seed + 1_000_003 * me.rank)
        return cls(policy, build_engine(rollout or RolloutConfig(), policy), optimizer, scheduler, kl_ctl, sampling,
                   torch.Generator().manual_seed(seed), me)

    def close(self) -> None:
        """Stop what this rank started besides the model: its environment workers."""
        if self.episodes is not None:
            self.episodes.close()

    def state_dict(self) -> dict:
        """What every rank holds alike (the optimizer and the sampling stream are saved per rank, see checkpoint)."""
        return {"scheduler": self.scheduler.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "shuffle": self.shuffle.get_state(), "iteration": self.iteration, "episode": self.episode,
                "data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.shuffle.set_state(state["shuffle"])
        self.iteration, self.episode = int(state["iteration"]), int(state["episode"])
        self.data = state.get("data")  # None in a checkpoint from before the prompt stream was saved


class Timers:
    """Wall-clock seconds per phase, reported as time/<phase>."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._open: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        """End a phase opened with `begin` (nothing if it is not open)."""
        if phase in self._open:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self._open.pop(phase)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start



def needs_logprob_recompute(cfg: RLHFConfig) -> bool:
    """Sampling-time logprobs equal a full recomputation in float32 without dropout; lower precisions recompute."""
    return (cfg.generation.recompute_logprobs if cfg.generation.recompute_logprobs is not None
            else cfg.model.dtype != "float32")


def rollout_logprobs(policy: Policy, rollout: Rollout, cfg: RLHFConfig, timers: Timers, me: Dist = SINGLE,
                     engine_weights: bool = False, reference: bool = True,
                     entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Behaviour logprobs [B, L-1] of this rank's rollouts, the reference's (None when not `reference`: a KL
    coefficient of 0 needs no reference pass) and the behaviour policy's entropies (when `entropy`), per micro-batch
    (every rank runs as many forward passes as the rank with the most: with FSDP each one is a collective).
    `engine_weights`: the rollouts come from an engine with its own copy of the weights, so the trainer always
    recomputes its own."""
    old, ref, entropies = [], [], []
    recompute = engine_weights or entropy or needs_logprob_recompute(cfg)
    temperature = cfg.generation.temperature
    chunks = micro_batches(len(rollout), cfg.generation.micro_batch_size)
    count = int(me.all_reduce(torch.tensor(len(chunks)), op="max"))
    for i in range(count):
        mb = chunks[i] if i < len(chunks) else slice(0, 1)  # a pass whose result is dropped
        tokens, lengths = rollout.tokens[mb], rollout.lengths[mb]
        with timers("logprobs"):
            if recompute:
                was_training = policy.model.training
                policy.model.eval()  # behaviour logprobs without (LoRA) dropout noise
                with torch.no_grad():
                    logp, ent = policy.logprobs(tokens, lengths, temperature, with_entropy=entropy)
                    logp = logp.cpu()
                policy.model.train(was_training)
            else:
                logp, ent = rollout.sample_logprobs[mb], None
        if reference:
            with timers("reference"):
                ref_logp = policy.logprobs(tokens, lengths, temperature, reference=True)[0].cpu()
        if i < len(chunks):
            old.append(logp)
            if reference:
                ref.append(ref_logp)
            if entropy:
                entropies.append(ent.cpu())
    mask = rollout.loss_mask
    return (torch.cat(old) * mask, torch.cat(ref) * mask if reference else None,
            torch.cat(entropies) * mask if entropy else None)


LossFn = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, dict]]


def global_rows(n_local: int, me: Dist) -> tuple[Tensor, int]:
    """Global numbers of this rank's rows (rank-major, as one rank would hold them) and the global count."""
    counts = me.all_gather_cat(torch.tensor([n_local]))
    offset = int(counts[:me.rank].sum())
    return torch.arange(offset, offset + n_local), int(counts.sum())


def actor_update(state: ActorState, rollout: Rollout, loss_fn: LossFn, row_weights: Tensor, minibatch_size: int,
                 epochs: int, micro_batch_size: int, grad_clip: float, temperature: float,
                 entropy_grad: bool = False) -> dict[str, float]:
    """The shared update loop (models/update.py) over this rank's rollouts: `loss_fn(new_logp, entropy, index)`
    returns the loss of the rows `index` aggregated over them and detached stats; `row_weights` [B] each row's weight
    in that aggregate (models/algorithms/base.Algorithm.loss). The entropy carries a graph only when `entropy_grad`
    (an entropy bonus is in the loss)."""
    policy, me = state.policy, state.me
    policy.model.train()
    rows, n_global = global_rows(len(rollout), me)

    def micro_loss(idx: Tensor):
        logp, entropy = policy.logprobs(rollout.tokens[idx], rollout.lengths[idx], temperature, with_entropy=True,
                                        entropy_grad=entropy_grad)
        return loss_fn(logp.cpu(), entropy.cpu(), idx)

    return minibatch_update(policy.trainable_parameters(), state.optimizer, state.scheduler, micro_loss, row_weights,
                            rows, n_global, minibatch_size, epochs, micro_batch_size, grad_clip, state.shuffle, me,
                            sharded=policy.sharded)


def common_metrics(state: ActorState, rollout: Rollout, scores: Tensor, gold: Tensor | None, kl_seq: Tensor | None,
                   non_score: Tensor, old_logp: Tensor, timers: Timers) -> dict[str, float]:
    """Metrics that mean the same for PPO and RLOO, over the rollouts of all ranks: TRL 1.x's names where TRL has
    the concept (reward, reward_std, kl, completions/*, learning_rate, step_time), ours where it has none
    (objective/*, episode, time/*; docs/metrics.md)."""
    me = state.me
    gather = me.all_gather_cat
    mask = rollout.loss_mask
    scores, non_score = gather(scores), gather(non_score)
    entropy = gather((-old_logp * mask).sum(1))
    response_lengths = gather(rollout.sampled_lengths).float()
    ended = gather(rollout.is_end.long()).bool()
    response_tokens = int(response_lengths.sum())
    seconds = {k: float(v)
               for k, v in zip(timers.seconds, me.all_reduce(torch.tensor(list(timers.seconds.values())), "max"))}
    metrics = {
        "reward": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "objective/kl_coef": float(state.kl_ctl.value),
        "objective/entropy": float(entropy.mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((scores + non_score).mean()),
        "completions/mean_length": float(response_lengths.mean()),
        "completions/min_length": float(response_lengths.min()),
        "completions/max_length": float(response_lengths.max()),
        "completions/clipped_ratio": float((~ended).float().mean()),  # hit max_new_tokens without a stop token
        "completions/mean_terminated_length": float(response_lengths[ended].mean()) if bool(ended.any()) else 0.0,
        "learning_rate": float(state.scheduler.get_last_lr()[0]),
        "episode": float(state.episode),
        "iteration": float(state.iteration),
        "tokens/generated": float(response_tokens),
        "dist/world_size": float(me.world_size),
    }
    if kl_seq is not None:  # the k1 KL to the reference (none is computed when beta is 0), per token and sequence
        kl_seq = gather(kl_seq)
        metrics.update({"kl": float(kl_seq.sum()) / max(response_tokens, 1), "objective/kl": float(kl_seq.mean())})
    if gold is not None:
        metrics["objective/gold_reward"] = float(gather(gold).mean())
    metrics.update({f"time/{k}": v for k, v in seconds.items() if k != "step"})  # the slowest rank's
    if "step" in seconds:
        metrics["step_time"] = seconds["step"]
    if "generate" in seconds:
        metrics["throughput/generate_tokens_per_s"] = response_tokens / max(seconds["generate"], 1e-9)
    return metrics
