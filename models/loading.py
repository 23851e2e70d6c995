"""Loading helpers shared by policy, critic and reward models: device/dtype resolution and friendly errors."""

from __future__ import annotations

import contextlib
import math
from functools import partial
from pathlib import Path

import torch
from torch import nn


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device: torch.device, dtype: str):
    """Compute in `dtype` while trainable weights and optimizer states stay float32 (AdamW in bf16 loses updates
    below the weight's precision; in fp16 its eps underflows). model.dtype; docs/memory.md."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def from_pretrained(auto_class, path: str, field: str, **kwargs):
    """`auto_class.from_pretrained(path)` with the config field named in any error; `path` is a local directory (a
    job's pinned source: its config's `local_path(field)`, models/resolve.py)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{field}: model path '{path}' does not exist (a directory saved with save_pretrained)")
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except Exception as exc:
        raise RuntimeError(f"{field}: could not load '{path}' with {auto_class.__name__}: {exc}") from exc


def checkpoint_activations(model: nn.Module, field: str) -> nn.Module:
    """model.gradient_checkpointing: each transformer block keeps only its input for the backward pass and recomputes
    the rest there (transformers' activation checkpointing, non-reentrant `torch.utils.checkpoint`), so activation
    memory holds one block's activations instead of every block's, for about one more forward pass of compute. Only
    in training mode: sampling (eval mode) and frozen models are untouched."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.gradient_checkpointing: {field} is a {type(model).__name__}, which does not support "
                         f"activation checkpointing; set model.gradient_checkpointing=false")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def disable_dropout(model: nn.Module) -> nn.Module:
    """RL fine-tuning runs without dropout (logprobs must be deterministic between rollout and training)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def base_dtype(dtype: str, lora) -> torch.dtype:
    """The dtype a trained model is loaded in (one precision policy for the policy, the critic and the reward model:
    docs/memory.md): float32 master weights for a full fine-tune (autocast computes in `dtype`); with LoRA the frozen
    base in the compute dtype `dtype`, as peft, TRL and veRL load it (its adapters stay float32:
    `adapters_in_float32`)."""
    return DTYPES[dtype] if lora is not None and lora.enabled else torch.float32


def adapters_in_float32(model: nn.Module) -> nn.Module:
    """The trainable parameters of a LoRA model (its adapters, a reward model's score head in modules_to_save) in
    float32, whatever the dtype of the frozen base they sit on: AdamW in bf16 would lose updates below a weight's
    precision (peft upcasts the adapters of a bf16 base already; a copied score head it does not)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of the base LR at optimizer step `step`: a linear warm-up from 0 over `warmup_steps`, then
    constant, or a decay to 0 at `total_steps`, half a cosine period or linear (transformers' `get_scheduler`
    formulas, whose import pulls in its trainer utilities and peft: ~3.3 CPU-s in a process that builds an
    optimizer)."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if schedule == "constant":
        return 1.0
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))


def make_optimizer(params, optim) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (fused where the device supports it) + `lr_factor`'s schedule over `total_steps` (OptimConfig). The
    scheduler's state is what transformers' was (a LambdaLR of a partial), so its checkpoints load either way."""
    params = [p for p in params if p.requires_grad]
    fused = all(p.device.type in ("cuda", "cpu") for p in params)
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                  fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_factor, schedule=optim.schedule, warmup_steps=optim.warmup_steps, total_steps=optim.total_steps or 10**9))
    return optimizer, scheduler
