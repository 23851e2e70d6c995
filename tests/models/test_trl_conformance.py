"""The loss menu against TRL 1.16's own GRPOTrainer code (trl/trainer/grpo_trainer.py), on the same batches in
float64: for every loss_type x importance_sampling_level x vLLM importance-sampling mode TRL implements, with and
without its k3 KL in the loss and its high-entropy token mask, `GRPOTrainer._compute_loss` and our
models/losses.policy_objective + aggregate give the same loss and the same gradient with respect to the per-token
logprobs (1e-6 relative, float64). TRL's advantages (scale_rewards group / batch / none) and its mismatch weights are
computed by its own `_generate_and_score_completions` on fixed completions and compared with ours.

TRL's trainer is built without its __init__ for the loss (the attributes its __init__ sets from a GRPOConfig, and a
`_get_per_token_logps_and_entropies` that returns float64 leaves we control: its fused LM head would compute in
float32), and with its __init__ on the tiny policy for the advantages (its `_generate` returns fixed token lists).
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections import defaultdict

import pytest
import torch

from models.advantages import AdvantageInputs, grpo_estimator, k3
from models.losses import Menu, aggregate, high_entropy_mask, mismatch_weights, policy_objective

pytestmark = pytest.mark.fast

trl = pytest.importorskip("trl")
F64 = torch.float64
B, C, MAX_LEN = 6, 7, 7
# TRL's loss_type = a policy loss of the menu and an aggregation (docs/algorithms.md)
LOSS_TYPES = {"grpo": ("ppo", "seq-mean-token-mean"), "bnpo": ("ppo", "token-mean"),
              "dr_grpo": ("ppo", "seq-mean-token-sum-norm"), "dapo": ("ppo", "token-mean"),
              "cispo": ("cispo", "token-mean"), "sapo": ("sapo", "seq-mean-token-mean"),
              "luspo": ("ppo", "seq-mean-token-sum"), "vespo": ("vespo", "token-mean")}
IS_MODES = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CLIP = (0.6, 1.5)  # vllm_importance_sampling_clip_min / _max: both sides bind on the batches below


def grpo_config(**kwargs):
    defaults = dict(output_dir="/tmp/rlhf-trl-conformance", report_to=[], use_cpu=True, bf16=False,
                    per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_LEN,
                    logging_steps=1)
    return trl.GRPOConfig(**{**defaults, **kwargs})


def bare_trainer(**kwargs) -> "trl.GRPOTrainer":
    """A GRPOTrainer with the attributes its __init__ sets from the config that _compute_loss reads (one process,
    no gradient accumulation)."""
    from accelerate import Accelerator

    use_vllm = "vllm_importance_sampling_mode" in kwargs
    args = grpo_config(**kwargs)
    t = object.__new__(trl.GRPOTrainer)
    t.args, t.accelerator = args, Accelerator(cpu=True)  # the Accelerator after the config (it resets its state)
    t.model = torch.nn.Linear(1, 1).train()  # _compute_loss reads .training only
    t.current_gradient_accumulation_steps = 1
    for name in ("max_completion_length", "temperature", "vllm_importance_sampling_correction",
                 "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                 "vllm_importance_sampling_clip_min", "loss_type", "scale_rewards", "importance_sampling_level",
                 "off_policy_mask_threshold", "mask_truncated_completions", "top_entropy_quantile", "entropy_coef",
                 "use_adaptive_entropy", "num_iterations", "beta"):
        setattr(t, name, getattr(args, name))
    t.use_vllm = use_vllm
    t._entropy_bonus_enabled = t.entropy_coef != 0.0
    t._last_world_entropy, t._entropy_window_stats = float("inf"), None
    t.aux_loss_enabled, t.router_aux_loss_coef = False, 0.0
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


def batch(seed: int) -> dict:
    """Right-padded completions of B rows (lengths 2..C), logprobs near their old values (ratios that clip on both
    sides), the reference's and the engine's nearby, signed advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([C, 2, 5, C, 3, 6])
    mask = (torch.arange(C).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    old = -torch.rand(B, C, generator=g, dtype=F64) * 3 * mask
    logp = old + 0.35 * torch.randn(B, C, generator=g, dtype=F64) * mask
    ref = old + 0.3 * torch.randn(B, C, generator=g, dtype=F64) * mask
    engine = old + 0.25 * torch.randn(B, C, generator=g, dtype=F64) * mask
    entropy = torch.rand(B, C, generator=g, dtype=F64) * 3
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, 0.0, 0.8], dtype=F64)
    return {"mask": mask, "old": old, "logp": logp, "ref": ref, "engine": engine, "entropy": entropy, "adv": adv}


def trl_loss(b: dict, loss_type: str, level: str, mode: str | None, beta: float, quantile: float, **extra):
    """TRL's loss and its gradient with respect to the logprobs."""
    kwargs = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, top_entropy_quantile=quantile,
                  **extra)
    if mode is not None:
        kwargs.update(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=CLIP[0],
                      vllm_importance_sampling_clip_max=CLIP[1])
    t = bare_trainer(**kwargs)
    logp = b["logp"].clone().requires_grad_(True)
    entropy = b["entropy"].clone().requires_grad_(True)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy if k.get("compute_entropy") else None, None)
    inputs = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.ones(B, C, dtype=torch.long), "completion_mask": b["mask"].long(),
              "advantages": b["adv"], "old_per_token_logps": b["old"], "num_items_in_batch": b["mask"].sum(),
              "ref_per_token_logps": b["ref"], "sampling_per_token_logps": b["engine"]}
    if mode is not None:
        inputs["importance_sampling_ratio"] = trl_is_ratio(b, mode)
    loss = t._compute_loss(None, inputs)
    grads = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return loss.detach(), grads


def trl_is_ratio(b: dict, mode: str) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio as _generate_and_score_completions builds it (checked against TRL's own
    code in test_trl_s_advantages_and_mismatch_weights_are_ours)."""
    delta = torch.nan_to_num((b["old"] - b["engine"]) * b["mask"], nan=0.0)
    ratio = torch.exp(delta) if mode.startswith("token") else torch.exp(delta.sum(1, keepdim=True))
    if mode.endswith("truncate"):
        return ratio.clamp(min=CLIP[0], max=CLIP[1])
    return torch.where((ratio < CLIP[0]) | (ratio > CLIP[1]), torch.zeros_like(ratio), ratio)


def our_loss(b: dict, loss_type: str, level: str, mode: str | None, beta: float, quantile: float, **extra):
    policy, agg = LOSS_TYPES[loss_type]
    epsilon = extra.get("epsilon", 0.2)
    menu = Menu(policy_loss=policy, importance_sampling_level=level, loss_agg_mode=agg, epsilon=epsilon,
                epsilon_high=extra.get("epsilon_high") or epsilon, delta=extra.get("delta"),
                entropy_coef=extra.get("entropy_coef", 0.0),
                off_policy_mask_threshold=extra.get("off_policy_mask_threshold"), kl_in_loss=True, kl_estimator="k3",
                max_len=MAX_LEN)
    logp = b["logp"].clone().requires_grad_(True)
    entropy = b["entropy"].clone().requires_grad_(True)
    weights = None if mode is None else mismatch_weights(b["old"], b["engine"], b["mask"], mode, *CLIP)
    emask = high_entropy_mask(entropy.detach(), b["mask"], quantile) if quantile < 1 else None
    per_token, _ = policy_objective(logp, b["old"], b["adv"], b["mask"], menu, ref_logp=b["ref"], beta=beta,
                                    entropy=entropy, entropy_mask=emask, is_weights=weights,
                                    engine_logp=b["engine"] if mode is not None or "off_policy_mask_threshold" in extra
                                    else None)
    loss = aggregate(per_token, b["mask"], agg, MAX_LEN)
    grads = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return loss.detach(), grads


CASES = [(t, lvl, m, beta, q) for t, lvl, m, beta, q in
         itertools.product(LOSS_TYPES, ["token", "sequence"], IS_MODES, [0.0, 0.04], [1.0, 0.5])
         if not (t == "vespo" and (lvl == "sequence" or (m or "").startswith("sequence")))]  # TRL refuses these


@pytest.mark.parametrize("loss_type,level,mode,beta,quantile", CASES)
def test_the_menu_gives_trl_s_loss_and_gradient(loss_type, level, mode, beta, quantile):
    b = batch(zlib.crc32(f"{loss_type} {level} {mode} {beta} {quantile}".encode()) % 1000)
    theirs, (their_grad, _) = trl_loss(b, loss_type, level, mode, beta, quantile)
    ours, (our_grad, _) = our_loss(b, loss_type, level, mode, beta, quantile)
    assert their_grad is not None and float(their_grad.abs().max()) > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("loss_type,extra", [
    ("dapo", {"epsilon_high": 0.28}),  # clip-higher
    ("grpo", {"delta": 1.2}), ("dapo", {"delta": 1.2, "epsilon_high": 0.28}), ("luspo", {"delta": 1.2}),
    ("cispo", {"epsilon_high": 5.0}), ("cispo", {"epsilon_high": 1.1}),
    ("dapo", {"entropy_coef": 0.05}), ("bnpo", {"entropy_coef": 0.05}),  # TRL's bonus is a token mean: as ours here
    ("grpo", {"off_policy_mask_threshold": 0.02}), ("dapo", {"off_policy_mask_threshold": 0.05}),
])
def test_trl_s_other_settings_are_the_menu_s(loss_type, extra):
    """TRL's two-sided clip `delta`, clip-higher, cispo's cap, the entropy bonus and the off-policy sequence mask."""
    b = batch(7)
    theirs, (their_grad, their_entropy_grad) = trl_loss(b, loss_type, "token", "token_truncate", 0.04, 1.0, **extra)
    ours, (our_grad, our_entropy_grad) = our_loss(b, loss_type, "token", "token_truncate", 0.04, 1.0, **extra)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-9)
    if "entropy_coef" in extra:
        torch.testing.assert_close(our_entropy_grad, their_entropy_grad, rtol=1e-6, atol=1e-9)


def reward_a(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def reward_b(completions, **kwargs):
    return [float(sum(map(ord, c)) % 5) / 4 for c in completions]


def test_trl_s_advantages_and_mismatch_weights_are_ours(tiny_models):
    """TRL's own _generate_and_score_completions (its `_generate` answering fixed completions and engine logprobs)
    gives the advantages of our grpo estimator for scale_rewards group / batch / none (two weighted reward functions)
    and our mismatch weights for every mode; `mask_truncated_completions` masks the rows ours does."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("trl").setLevel(logging.ERROR)
    G, N, width = 4, 8, 5
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["policy"])
    args = grpo_config(num_generations=G, per_device_train_batch_size=N, reward_weights=[1.0, 0.5], beta=0.04,
                       max_completion_length=width)
    t = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_models["policy"]),
                        reward_funcs=[reward_a, reward_b], args=args,
                        train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"] * 4}), processing_class=tokenizer)
    t.use_vllm = True
    t.ref_model = torch.nn.Linear(1, 1)  # the reference's logprobs are answered below
    eos = t.eos_token_ids[0]
    prompts = [[5, 6, 7]] * G + [[8, 9]] * G
    completions = [[11, 12, 13, eos], [13, 14, 15, 16, 17], [10, eos], [19, 20, 21], [22, 23, 9, 3, eos], [24, eos],
                   [25, 27, 29, 31, 33], [30, 31, 32, 33, 34]]
    lengths = torch.tensor([len(c) for c in completions])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(N, width, generator=g, dtype=F64) * 2 * mask
    engine = [[float(old[i, j]) + 0.3 * float(torch.randn((), generator=g)) for j in range(len(c))]
              for i, c in enumerate(completions)]
    texts = [" ".join(map(str, c)) for c in completions]
    t._generate = lambda _: (prompts, completions, None, texts, engine, {}, None, [])
    t._get_per_token_logps_and_entropies = lambda model, *a, **k: (old, None, None)
    engine_t = torch.zeros(N, width)
    for i, row in enumerate(engine):
        engine_t[i, :len(row)] = torch.tensor(row)
    scores = torch.tensor(reward_a(texts), dtype=torch.float32) + 0.5 * torch.tensor(reward_b(texts),
                                                                                     dtype=torch.float32)
    truncated = torch.tensor([c[-1] != eos for c in completions])
    for scale, (mode, low, high), masked in itertools.product(
            ["group", "batch", "none"], [("token_truncate", 0.7, 1.3), ("token_mask", 0.7, 1.3),
                                         ("sequence_truncate", None, 2.0), ("sequence_mask", 0.7, 1.3)], [False, True]):
        t.scale_rewards, t.mask_truncated_completions = scale, masked
        t.vllm_importance_sampling_mode = mode
        t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max = low, high
        out = t._generate_and_score_completions([{"prompt": "p"}] * N)
        m = mask * (~truncated).unsqueeze(1).to(F64) if masked else mask
        ours = grpo_estimator(AdvantageInputs(scores, torch.zeros(N, width), 0.0, torch.ones(N, 1), G,
                                              scale_rewards=scale)).advantages[:, 0]
        torch.testing.assert_close(out["advantages"].double(), ours.double(), rtol=1e-5, atol=1e-6,
                                   msg=f"{scale}")
        torch.testing.assert_close(out["completion_mask"].double(), m)
        torch.testing.assert_close(out["importance_sampling_ratio"].double(),
                                   mismatch_weights(old, engine_t.double(), m, mode, low, high), rtol=1e-5, atol=1e-6,
                                   msg=f"{mode} {masked}")


def test_the_k3_estimator_is_trl_s():
    """TRL's per-token KL: exp(ref - logp) - (ref - logp) - 1 (unclamped), as models/advantages.k3."""
    b = batch(1)
    d = b["ref"] - b["logp"]
    torch.testing.assert_close(k3(b["logp"], b["ref"]), torch.exp(d) - d - 1, rtol=1e-12, atol=1e-12)
