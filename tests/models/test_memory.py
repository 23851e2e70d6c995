"""Memory settings (docs/memory.md) against the float32 run on the same data: activation checkpointing
(model.gradient_checkpointing) and bf16 compute with float32 master weights (model.dtype; with FSDP2 on 2 ranks,
its MixedPrecisionPolicy), on fixed rollouts, on the CPU.

Tolerances, and why: checkpointing recomputes the same float32 ops on the same data, so gradients and updates agree
to float32 round-off (1e-6). bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per value), so logits differ by
~1e-2 and gradients by ~0.3 % here; AdamW normalises each weight's step, so a weight whose gradient is near zero can
step the other way. The update of bf16 against float32 is therefore held to a direction (cosine >= 0.99; measured
0.998 on one and two ranks) and a size (relative difference <= 0.15; measured 0.06), and the step's metrics to what
a 0.3 % gradient difference allows (measured: grad norm 0.15 %, value loss 0.2 %).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from models import distributed
from models.config import CriticConfig, LoraConfig, Sampling, merge, preset
from models.critic import CriticTrainer
from models.loading import checkpoint_activations
from models.loop import build_actor, load_prompts
from models.policy import Policy
from models.prepare import prepare_run
from tests.conftest import free_port_block
from tests.models.dist_update import ranks_env, update

SCRIPT = Path(__file__).with_name("dist_update.py")


def _batch(n: int = 12, length: int = 20):
    tokens = torch.randint(4, 60, (n, length), generator=torch.Generator().manual_seed(0))
    lengths = torch.randint(length // 2, length + 1, (n,), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(1, length)[None, :] < lengths[:, None]).float()
    return tokens, lengths, mask


def saved_bytes(fn) -> tuple[object, int]:
    """fn()'s result and the bytes autograd saved for the backward pass while it ran (the activation memory)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        return fn(), total


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointing_keeps_the_gradients_and_drops_the_saved_activations(tiny_models, lora):
    """The actor with model.gradient_checkpointing: the same logprobs and gradients as without (float32: 1e-6), and
    far fewer bytes saved for the backward pass (each block keeps its input only)."""
    tokens, lengths, mask = _batch()
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the LoRA adapters' initialisation
        policy = Policy.load(tiny_models["policy"], LoraConfig(enabled=lora, r=4), gradient_checkpointing=checkpointing)
        policy.model.train()
        (logp, _), saved = saved_bytes(lambda: policy.logprobs(tokens, lengths))
        (-(logp * mask).sum() / mask.sum()).backward()
        grads = {name: p.grad.clone() for name, p in policy.model.named_parameters() if p.requires_grad}
        runs.append((logp.detach(), grads, saved))
    (logp, grads, saved), (logp_ckpt, grads_ckpt, saved_ckpt) = runs
    torch.testing.assert_close(logp_ckpt, logp, rtol=0, atol=1e-6)
    assert grads_ckpt.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=1e-6, msg=name)
    assert saved_ckpt < saved / 3, (saved_ckpt, saved)  # measured: 0.62 MB against 6.6 MB (full)


def test_critic_checkpointing_trains_alike(tiny_models):
    """The critic trainer with model.gradient_checkpointing takes the same steps (float32: 1e-6)."""
    tokens, lengths, mask = _batch(8, 16)
    mask = torch.cat([mask, torch.zeros(8, 1)], 1)
    returns = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)) * mask
    results = []
    for checkpointing in (False, True):
        trainer = CriticTrainer(CriticConfig(micro_batch_size=4, train_batch_size=8, epochs=1), tiny_models["critic"],
                                None, False, gradient_checkpointing=checkpointing)
        metrics = trainer.train(tokens, returns, torch.zeros_like(returns), mask)
        results.append((metrics, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
    (metrics, weights), (metrics_ckpt, weights_ckpt) = results
    assert metrics_ckpt["loss_mean"] == pytest.approx(metrics["loss_mean"], rel=1e-6)
    assert metrics_ckpt["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5) and metrics["grad_norm"] > 0
    for name, value in weights.items():
        torch.testing.assert_close(weights_ckpt[name], value, rtol=0, atol=1e-6, msg=name)


def test_checkpointing_a_model_that_cannot_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="model.gradient_checkpointing: model.critic is a Linear"):
        checkpoint_activations(nn.Linear(2, 2), "model.critic")


def _delta(weights: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(weights[name] - initial[name]).flatten() for name in initial])


def test_bf16_with_checkpointing_updates_like_float32_on_one_and_two_ranks(tiny_models, tmp_path):
    """One PPO update (actor and critic) on fixed rollouts with model.dtype=bfloat16 and model.gradient_checkpointing,
    on 1 rank (autocast) and on 2 ranks (FSDP2 with its MixedPrecisionPolicy), against float32 on 1 rank: float32
    master weights, and an update within the module's stated tolerance of the float32 one."""
    cfg = prepare_run(preset("tiny", **{
        "deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"], "algorithm": "ppo",
        "model.reward": tiny_models["reward"], "ppo.rollout_batch_size": 12, "ppo.minibatch_size": 6,
        "generation.max_new_tokens": 8, "generation.micro_batch_size": 4, "critic.micro_batch_size": 8}))
    prompts = load_prompts(cfg)[:12]
    actor = build_actor(cfg)
    initial = {name: value.clone() for name, value in actor.policy.model.state_dict().items()}
    rollout = actor.engine.generate(actor.policy.encode_prompts(prompts), 1, Sampling.of(cfg.generation),
                                    torch.Generator().manual_seed(5))
    fixture = {"prompts": prompts, "tokens": rollout.tokens, "prompt_lengths": rollout.prompt_lengths,
               "lengths": rollout.lengths, "is_end": rollout.is_end, "sample_logprobs": rollout.sample_logprobs}
    low = merge(cfg, {"model.dtype": "bfloat16", "model.gradient_checkpointing": True})
    torch.save(fixture, tmp_path / "fixture.pt")
    (tmp_path / "cfg.json").write_text(low.model_dump_json())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full, full_metrics, _ = update(cfg, fixture, distributed.SINGLE)
        one, one_metrics, _ = update(low, fixture, distributed.SINGLE)
    finally:
        torch.set_num_threads(threads)
    env = ranks_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port_block(2)), str(SCRIPT), str(tmp_path / "cfg.json"),
                           str(tmp_path / "fixture.pt"), str(tmp_path / "two.pt")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt", weights_only=False)

    reference = _delta(full, initial)
    assert float(reference.abs().max()) > 1e-4  # the float32 update moved the weights
    for label, weights, metrics in (("1 rank", one, one_metrics), ("2 ranks", two["weights"], two["metrics"])):
        assert all(value.dtype == torch.float32 for value in weights.values()), label  # master weights stay float32
        delta = _delta(weights, initial)
        cosine = float(torch.nn.functional.cosine_similarity(delta, reference, dim=0))
        relative = float((delta - reference).norm() / reference.norm())
        assert cosine >= 0.99 and relative <= 0.15, (label, cosine, relative)
        assert relative > 1e-4, label  # computed in bf16 indeed (float32 would agree to round-off)
        assert metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=0.02), label
        assert metrics["loss/value_avg"] == pytest.approx(full_metrics["loss/value_avg"], rel=0.02), label
        assert metrics["loss"] == pytest.approx(full_metrics["loss"], abs=5e-3), label
        # the frozen reference is stored in bf16: the KL at the first step is bf16 rounding (0 in float32)
        assert full_metrics["objective/kl"] == pytest.approx(0.0, abs=1e-6)
        assert abs(metrics["objective/kl"]) <= 0.05, label
