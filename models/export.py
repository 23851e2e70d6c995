"""The trained policy as a plain Hugging Face model: what `rlhf export` writes and every run leaves in its store.

A checkpoint's `actor/` holds the full weights (save_pretrained, float32 master weights) or, for LoRA, the adapter
alone. Exporting gives one directory that `AutoModelForCausalLM.from_pretrained(DIR)` loads with nothing of this
project installed: the weights (LoRA merged into the base: base + scale * B @ A, as peft's merge_and_unload does) in
the run's model.dtype as safetensors, the model's config and generation config (its stop tokens, sampling defaults),
and the tokenizer with its chat template. Like veRL's model merger and OpenRLHF's LoRA combiner, the result is the
model a user serves or pushes to the hub.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from models.loading import DTYPES

ADAPTER_CONFIG = "adapter_config.json"


def is_lora(actor_dir: str | Path) -> bool:
    """Whether a checkpoint's actor/ holds a LoRA adapter (rather than full weights)."""
    return (Path(actor_dir) / ADAPTER_CONFIG).is_file()


def export_policy(actor_dir: str | Path, out_dir: str | Path, base: str | None = None,
                  dtype: str = "float32") -> Path:
    """Write the policy of a checkpoint's `actor_dir` to `out_dir` as a Hugging Face model (see the module
    docstring). `base`: the local directory of the model the run started from (model.policy, resolved), needed to
    merge a LoRA adapter. `out_dir` must not exist or be empty."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only an export needs them here

    actor_dir, out_dir = Path(actor_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"export: {out_dir} is not empty; give a new directory")
    if is_lora(actor_dir):
        if base is None:
            raise ValueError(f"export: {actor_dir} holds a LoRA adapter; merging it needs the base model (model.policy)")
        from peft import PeftModel  # heavy: peft is needed only with LoRA

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          actor_dir).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.to(DTYPES[dtype]).save_pretrained(staging)  # config, generation_config.json, model.safetensors
    AutoTokenizer.from_pretrained(actor_dir if (actor_dir / "tokenizer_config.json").exists() else base).save_pretrained(
        staging)  # with its chat template
    if out_dir.exists():
        out_dir.rmdir()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out_dir)
    return out_dir
