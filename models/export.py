"""A trained model as a plain Hugging Face model: the one export of every job (an RL run's policy, the SFT and
reward-model stages' models), what `rlhf export` writes and what every run leaves in its store.

A checkpoint's trained part (`actor/` of an RL run, `trainee/` of a stage) holds the full weights (save_pretrained,
float32 master weights) or, for LoRA, the adapter alone (a reward model's adapter with its score head). Exporting
gives one directory that `AutoModelFor...from_pretrained(DIR)` loads with nothing of this project installed:

- the weights as safetensors in the job's compute dtype (model.dtype; a stage's `dtype`): the dtype is kept, so an
  RL run's model and the pipeline's are the same bytes;
- a LoRA adapter merged into the base it was trained on (base + scale * B @ A, as peft's merge_and_unload does),
  the base loaded in float32 for the merge; the base is the run's model as it pinned it (models/resolve.py: within
  the run, its pin; later, `rlhf export`, found here again at the hub commit it pinned) and is checked against the
  digest the run recorded when it trained (`base_digest`): a base that changed since (a local directory rewritten,
  another s3 object) is refused instead of merged;
- the model's config (`config` entries added: a reward model's reward statistics) and generation config (its stop
  tokens, sampling defaults), and the tokenizer with its chat template;
- written into a staging directory beside `out_dir` and renamed into place: a crash leaves no half model.

Like veRL's model merger and OpenRLHF's LoRA combiner, the result is the model a user serves or pushes to the hub.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from models.loading import DTYPES
from models.resolve import Resolved, directory_digest

ADAPTER_CONFIG = "adapter_config.json"
TASKS = ("causal-lm", "sequence-classification")  # a policy; a reward model (one label)


def export_spec(part: str, task: str, dtype: str, base: Resolved) -> dict:
    """What a checkpoint's manifest says about exporting it (components/export.export_checkpoint): its trained part,
    the task, the dtype, and the base a LoRA adapter merges onto as the job pinned it (its value, revision and field,
    the hub commit it resolved to, the digest of its files)."""
    return {"part": part, "task": task, "dtype": dtype,
            "base": {"value": base.value, "revision": base.revision, "field": base.field,
                     "commit": base.details.get("commit"), "digest": base.digest}}


def is_lora(trained_dir: str | Path) -> bool:
    """Whether a checkpoint's trained part holds a LoRA adapter (rather than full weights)."""
    return (Path(trained_dir) / ADAPTER_CONFIG).is_file()


def export_model(trained_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str = "float32",
                 task: str = "causal-lm", config: dict | None = None, base_digest: str | None = None) -> Path:
    """Write the model of a checkpoint's trained part `trained_dir` to `out_dir` as a Hugging Face model (see the
    module docstring). `base`: the local directory of the model the job started from, needed to merge a LoRA
    adapter, checked against `base_digest` when given. `out_dir` must not exist or be empty."""
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,  # heavy: export only
                              AutoTokenizer)

    if task not in TASKS:
        raise ValueError(f"export: unknown task {task!r}; known: {', '.join(TASKS)}")
    trained_dir, out_dir = Path(trained_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"export: {out_dir} is not empty; give a new directory")
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    labels = {} if task == "causal-lm" else {"num_labels": 1}
    if is_lora(trained_dir):
        if base is None:
            raise ValueError(f"export: {trained_dir} holds a LoRA adapter; merging it needs the base model it was "
                             f"trained on (model.policy)")
        if base_digest is not None and (found := directory_digest(base)) != base_digest:
            raise ValueError(f"export: the base model at {base} is not the one the adapter was trained on: its files' "
                             f"digest is {found}, the run recorded {base_digest}; point the run's model at that base")
        from peft import PeftModel  # heavy: peft is needed only with LoRA

        model = PeftModel.from_pretrained(auto.from_pretrained(base, dtype=torch.float32, **labels),
                                          trained_dir).merge_and_unload()
    else:
        model = auto.from_pretrained(trained_dir, dtype=torch.float32, **labels)
    tokenizer = AutoTokenizer.from_pretrained(trained_dir if (trained_dir / "tokenizer_config.json").exists() else base)
    if task != "causal-lm" and model.config.pad_token_id is None:  # HF's pooling needs it (we score by length)
        model.config.pad_token_id = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                     else tokenizer.eos_token_id)
    for key, value in (config or {}).items():
        setattr(model.config, key, value)
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.to(DTYPES[dtype]).save_pretrained(staging)  # config, generation_config.json, model.safetensors
    tokenizer.save_pretrained(staging)  # with its chat template
    if out_dir.exists():
        out_dir.rmdir()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out_dir)
    return out_dir


def export_policy(actor_dir: str | Path, out_dir: str | Path, base: str | None = None, dtype: str = "float32",
                  base_digest: str | None = None) -> Path:
    """`export_model` of a policy (a causal LM)."""
    return export_model(actor_dir, out_dir, base, dtype, "causal-lm", base_digest=base_digest)
