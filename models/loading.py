"""Loading helpers shared by policy, critic and reward models: device/dtype resolution and friendly errors."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(device: torch.device, dtype: str):
    """Compute in `dtype` while trainable weights and optimizer states stay float32 (AdamW in bf16 loses updates
    below the weight's precision; in fp16 its eps underflows)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_model_path(path: str, field: str) -> str:
    """Refuse a path that is neither a local directory nor a hub id before any weights are touched."""
    p = Path(path)
    looks_local = p.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1
    if p.is_dir():
        return path
    if looks_local or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(
            f"{field}: model path '{path}' does not exist (expected a directory saved with save_pretrained, "
            f"or a hub id 'org/name'); build the tiny models with `rlhf models tiny`")
    return path


def from_pretrained(auto_class, path: str, field: str, **kwargs):
    """`auto_class.from_pretrained(path)` with the config field named in any error."""
    check_model_path(path, field)
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the field that pointed here
        raise RuntimeError(f"{field}: could not load '{path}' with {auto_class.__name__}: {exc}") from exc


def disable_dropout(model: nn.Module) -> nn.Module:
    """RL fine-tuning runs without dropout (logprobs must be deterministic between rollout and training)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_optimizer(params, optim) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW + linear warm-up then constant/cosine/linear decay (OptimConfig)."""
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    total = optim.total_steps or 10**9

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = min(1.0, (step - optim.warmup_steps) / max(1, total - optim.warmup_steps))
        if optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if optim.schedule == "linear":
            return 1.0 - progress
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
