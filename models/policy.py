"""The actor: a causal LM (full fine-tune or LoRA), per-token logprobs, the frozen reference, and its weights for a
rollout engine. Sampling is the rollout engine's job (models/engines/).

Per-token tensors are [B, L-1] over actions: entry t scores tokens[:, t+1] of a right-padded `Rollout`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.config import LoraConfig
from models.data import encode
from models.distributed import SINGLE, Dist, full_state_dict, is_sharded, shard_model
from models.scoring import token_logprobs
from models.loading import (DTYPES, adapters_in_float32, autocast, base_dtype, checkpoint_activations, disable_dropout,
                            freeze, from_pretrained)
from models.engines.base import Rollout, Weights


def load_policy_tokenizer(path: str, field: str = "model.policy"):
    """The policy's tokenizer (pad = EOS when it has no pad token); what the data is read with before models load."""
    tokenizer = from_pretrained(AutoTokenizer, path, field)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{field}: tokenizer of '{path}' has no eos_token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class Policy:
    """Actor model + tokenizer + reference policy, with the few operations RLHF needs."""

    def __init__(self, model, tokenizer, lora: bool, reference=None, dtype: str = "float32", me: Dist = SINGLE,
                 device: torch.device | None = None):
        self.model, self.tokenizer, self.lora, self.dtype, self.me = model, tokenizer, lora, dtype, me
        self.reference = reference  # a frozen copy for full fine-tuning; None for LoRA (adapters disabled instead)
        self.device = device or next(model.parameters()).device
        self.sharded = is_sharded(model)
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        # every end-of-turn id the model declares (e.g. Llama-3's <|eot_id|>) stops a response, not only eos_token
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        declared = declared if isinstance(declared, (list, tuple)) else [declared]
        self.stop_ids = torch.tensor(sorted({self.eos_id, *[i for i in declared if i is not None]}))

    @classmethod
    def load(cls, path: str, lora: LoraConfig | None = None, dtype: str = "float32", device: str | torch.device = "cpu",
             field: str = "model.policy", me: Dist = SINGLE, shard: bool = False, reference_device: str = "auto",
             gradient_checkpointing: bool = False, reference: bool = True) -> "Policy":
        """Actor + tokenizer + frozen reference on this rank. `shard`: FSDP2 over the ranks (a full fine-tune); the
        reference then lives on the actor's device sharded alike, or as a CPU copy (`reference_device`).

        Memory (docs/memory.md): the trainable weights, their gradients and AdamW states stay float32 (master
        weights); `dtype` is the compute dtype (autocast; with FSDP2 also the dtype the blocks are all-gathered in,
        gradients reduced in float32) and the storage dtype of what is frozen: the reference, and with LoRA the base
        (the adapters float32). `gradient_checkpointing` recomputes
        each block's activations in the backward pass instead of keeping them. `reference=False`: no frozen copy
        (supervised fine-tuning needs none)."""
        device = torch.device(device)
        tokenizer = load_policy_tokenizer(path, field)
        model = disable_dropout(from_pretrained(AutoModelForCausalLM, path, field, dtype=base_dtype(dtype, lora)))
        model = model.to(device)
        if lora is not None and lora.enabled:  # replicated on every rank; only the adapters train and sync
            from peft import LoraConfig as PeftLoraConfig, get_peft_model  # heavy: peft is needed only with LoRA

            if gradient_checkpointing:
                checkpoint_activations(model, field)
            model = adapters_in_float32(get_peft_model(model, PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                task_type="CAUSAL_LM")))
            return cls(model, tokenizer, lora=True, dtype=dtype, me=me, device=device)
        if not reference:
            if gradient_checkpointing:
                checkpoint_activations(model, field)
            return cls(shard_model(model, dtype) if shard else model, tokenizer, lora=False, dtype=dtype,
                       me=me, device=device)
        on_actor = reference_on_actor_device(model, device, reference_device, me.world_size if shard else 1)
        reference = freeze(copy.deepcopy(model).to(device if on_actor else "cpu", DTYPES[dtype]))
        if gradient_checkpointing:  # the trainable model only: the reference never runs a backward pass
            checkpoint_activations(model, field)
        if shard:
            model = shard_model(model, dtype)
            if on_actor:
                reference = shard_model(reference, reshard_after_forward=True)
        return cls(model, tokenizer, lora=False, reference=reference, dtype=dtype, me=me, device=device)

    # ----------------------------------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], chat_template: bool = False,
                       templated: bool = False) -> list[list[int]]:
        """Token ids of plain prompts (`chat_template`: as a user turn of the chat template) or of rendered chat
        templates (`templated`); models/data.encode."""
        return encode(self.tokenizer, prompts, templated, chat_template)

    def decode_responses(self, rollout: Rollout) -> list[str]:
        out = []
        for row, start, end in zip(rollout.tokens.tolist(), rollout.prompt_lengths.tolist(), rollout.lengths.tolist()):
            out.append(self.tokenizer.decode(row[start:end], skip_special_tokens=True))
        return out

    # ----------------------------------------------------------------------------------------------------------------
    def logprobs(self, tokens: Tensor, lengths: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                 reference: bool = False, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Per-token logprobs [B, L-1] of tokens[:, 1:] (and entropies) under the actor or the frozen reference.

        Gradients flow for the actor unless called under torch.no_grad(); the reference never has gradients. The
        entropy is computed without a graph (it holds a [B, L, V] tensor) unless `entropy_grad` asks for one.
        """
        if reference:
            with torch.no_grad():
                if self.lora:
                    with self.model.disable_adapter(), autocast(self.device, self.dtype):
                        return token_logprobs(self.model, tokens.to(self.device), lengths.to(self.device), temperature,
                                              with_entropy)
                ref_device = next(self.reference.parameters()).device
                with autocast(ref_device, self.dtype):
                    return token_logprobs(self.reference, tokens.to(ref_device), lengths.to(ref_device), temperature,
                                          with_entropy)
        with autocast(self.device, self.dtype):
            return token_logprobs(self.model, tokens.to(self.device), lengths.to(self.device), temperature,
                                  with_entropy,
                                   entropy_grad)

    def engine_weights(self) -> Weights:
        """The actor's full weights under their Hugging Face names, for a rollout engine that holds its own copy:
        names, dtypes and shapes first, then the tensors one at a time, gathered from the FSDP2 shards (a collective:
        every rank iterates in step), LoRA merged into the base weights (base + scale * B @ A, the actor itself
        untouched), tied weights (lm_head) included."""
        if self.lora:
            from peft.tuners.lora import LoraLayer  # heavy: peft is needed only with LoRA

            base = self.model.get_base_model()
            state = {name: tensor for name, tensor in base.state_dict().items() if ".lora_" not in name}
            modules = {f"{name}.base_layer.weight": module for name, module in base.named_modules()
                       if isinstance(module, LoraLayer)}

            def merged() -> Iterator[Tensor]:
                for name, tensor in state.items():
                    module = modules.get(name)
                    delta = sum((module.get_delta_weight(adapter).detach() for adapter in module.active_adapters
                                 if adapter in module.lora_A), torch.zeros(())) if module is not None else None
                    yield tensor.detach() + delta.to(tensor.dtype) if delta is not None else tensor.detach()

            specs = [(name.replace(".base_layer.", "."), t.dtype, tuple(t.shape)) for name, t in state.items()]
            return Weights(specs, merged())
        state = self.model.state_dict()
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]  # a DTensor's shape is the full one
        return Weights(specs, ((t.full_tensor() if hasattr(t, "full_tensor") else t).detach()  # a DTensor: gathered
                               for t in state.values()))

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, directory) -> None:
        """HF save_pretrained (LoRA: the adapter only) plus the tokenizer, written by rank 0 from the full state dict
        (gathered from the shards, on CPU), so the checkpoint loads anywhere; a collective call on every rank."""
        save_trained(self.model, self.tokenizer, self.me, directory)

    def load_weights(self, directory) -> None:
        """Actor weights from a `save` directory (LoRA: the adapter), read by rank 0, into the (sharded) model on
        every rank."""
        load_trained(self.model, AutoModelForCausalLM, directory, self.lora, self.me)


def save_trained(model, tokenizer, me: Dist, directory) -> None:
    """A trained model (the actor, a stage's trainee) as HF save_pretrained (LoRA: its adapter) plus its tokenizer,
    written by rank 0 from the full state dict (gathered from the shards, on CPU); a collective call on every rank."""
    state = full_state_dict(model)
    if me.is_leader:
        model.save_pretrained(directory, state_dict=state)
        tokenizer.save_pretrained(directory)


def load_trained(model, auto_class, directory, lora: bool, me: Dist = SINGLE) -> None:
    """What `save_trained` wrote into `model` (sharded or not) on every rank, read by rank 0 alone (the directory may
    exist on its machine only) and broadcast: LoRA its adapter, else the full weights read as `auto_class`."""
    directory = Path(directory)
    if lora:
        from peft import set_peft_model_state_dict  # heavy: peft is needed only with LoRA

        adapter = load_file(str(directory / "adapter_model.safetensors")) if me.is_leader else None
        set_peft_model_state_dict(model, me.broadcast_object(adapter))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # heavy (~1.7 s)

    loaded = auto_class.from_pretrained(directory, dtype=torch.float32).state_dict() if me.is_leader else {}
    if me.active:  # sharded or replicated: tensor by tensor from rank 0 into each rank's part
        set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model.load_state_dict(loaded)


def reference_on_actor_device(model, device: torch.device, choice: str, shards: int) -> bool:
    """Whether the frozen reference goes on the actor's device ('auto': when its shard fits with a 20% margin)."""
    if choice != "auto":
        return choice == "actor"
    if device.type != "cuda":
        return device.type == "cpu"  # host memory either way: no copy to move
    free, _ = torch.cuda.mem_get_info(device)
    need = sum(p.numel() * p.element_size() for p in model.parameters()) / shards
    return free > 1.2 * need

