"""The actor: a causal LM (full fine-tune or LoRA), batched KV-cache sampling, per-token logprobs, the frozen reference.

Layouts: prompts are left-padded for generation; a finished `Rollout` is right-padded (prompt, response, pad), which
is also the critic server's wire layout. Per-token tensors are [B, L-1] over actions: entry t scores tokens[:, t+1].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.config import GenerationConfig, LoraConfig
from models.distributed import SINGLE, Dist, full_state_dict, is_sharded, shard_model
from models.loading import DTYPES, autocast, disable_dropout, freeze, from_pretrained


@dataclass
class Rollout:
    """A batch of sampled sequences, right-padded."""

    tokens: Tensor  # [B, L] int64: prompt, response (EOS included), pad
    prompt_lengths: Tensor  # [B]
    lengths: Tensor  # [B] prompt + response
    is_end: Tensor  # [B] bool: the response ended with EOS before max_new_tokens
    sample_logprobs: Tensor  # [B, L-1] logprobs at sampling time (temperature-scaled, before top-k/top-p), 0 off-response

    @property
    def response_mask(self) -> Tensor:
        """[B, L-1] float, 1 where tokens[:, t+1] belongs to the response."""
        positions = torch.arange(1, self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
        return ((positions >= self.prompt_lengths.unsqueeze(1)) & (positions < self.lengths.unsqueeze(1))).float()

    @property
    def response_lengths(self) -> Tensor:
        return self.lengths - self.prompt_lengths

    def __len__(self) -> int:
        return self.tokens.shape[0]


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
             mixed_precision: bool = False) -> "Policy":
        """Actor + tokenizer + frozen reference on this rank. `shard`: FSDP2 over the ranks (a full fine-tune); the
        reference then lives on the actor's device sharded alike, or as a CPU copy (`reference_device`)."""
        device = torch.device(device)
        tokenizer = from_pretrained(AutoTokenizer, path, field)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{field}: tokenizer of '{path}' has no eos_token")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # trainable weights stay float32; `dtype` is the compute dtype (autocast) and the frozen reference's dtype
        model = disable_dropout(from_pretrained(AutoModelForCausalLM, path, field, dtype=torch.float32)).to(device)
        if lora is not None and lora.enabled:  # replicated on every rank; only the adapters train and sync
            from peft import LoraConfig as PeftLoraConfig, get_peft_model

            model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                         target_modules=lora.target_modules, task_type="CAUSAL_LM"))
            return cls(model, tokenizer, lora=True, dtype=dtype, me=me, device=device)
        on_actor = reference_on_actor_device(model, device, reference_device, me.world_size if shard else 1)
        reference = freeze(copy.deepcopy(model).to(device if on_actor else "cpu", DTYPES[dtype]))
        if shard:
            model = shard_model(model, mixed_precision)
            if on_actor:
                reference = shard_model(reference, reshard_after_forward=True)
        return cls(model, tokenizer, lora=False, reference=reference, dtype=dtype, me=me, device=device)

    # ----------------------------------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], chat_template: bool = False) -> list[list[int]]:
        if chat_template:
            return [list(self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)) for p in prompts]
        return [self.tokenizer(p)["input_ids"] for p in prompts]  # special tokens as the model expects (e.g. BOS)

    def decode_responses(self, rollout: Rollout) -> list[str]:
        out = []
        for row, start, end in zip(rollout.tokens.tolist(), rollout.prompt_lengths.tolist(), rollout.lengths.tolist()):
            out.append(self.tokenizer.decode(row[start:end], skip_special_tokens=True))
        return out

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], gen: GenerationConfig, generator: torch.Generator | None = None) -> Rollout:
        """Sample responses for left-padded prompts with the KV cache; stop each row at EOS, stop all when all ended
        (on every rank: with FSDP each decoding step is a collective, so ranks stop together)."""
        model = self.model
        was_training = model.training
        model.eval()
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        if min(len(p) for p in prompt_ids) == 0:
            raise ValueError("prompts: every prompt must have at least one token")
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attention = torch.zeros((B, P), dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, P - len(ids):] = torch.tensor(ids)
            attention[i, P - len(ids):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        new_tokens, new_logps = [], []
        past, step_input, position = None, input_ids, (attention.cumsum(1) - 1).clamp(min=0)
        for _ in range(gen.max_new_tokens):
            with autocast(self.device, self.dtype):
                out = model(input_ids=step_input, attention_mask=attention, position_ids=position,
                            past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float() / gen.temperature
            logps = torch.log_softmax(logits, dim=-1)
            next_token = sample(logits, gen.top_k, gen.top_p, generator)
            token_logp = logps.gather(1, next_token.unsqueeze(1)).squeeze(1)
            next_token = torch.where(finished, torch.full_like(next_token, self.pad_id), next_token)
            new_tokens.append(next_token)
            new_logps.append(torch.where(finished, torch.zeros_like(token_logp), token_logp))
            finished |= torch.isin(next_token, self.stop_ids.to(next_token.device))
            if int(self.me.all_reduce((~finished).sum().cpu())) == 0:
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)  # finished rows: ignored
            step_input = next_token.unsqueeze(1)
            position = position[:, -1:] + 1
        model.train(was_training)
        return _right_pad(prompt_ids, torch.stack(new_tokens, 1).cpu(), torch.stack(new_logps, 1).cpu(),
                          self.stop_ids, self.pad_id)

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
                        return _token_logprobs(self.model, tokens.to(self.device), lengths.to(self.device), temperature, with_entropy)
                ref_device = next(self.reference.parameters()).device
                with autocast(ref_device, self.dtype):
                    return _token_logprobs(self.reference, tokens.to(ref_device), lengths.to(ref_device), temperature, with_entropy)
        with autocast(self.device, self.dtype):
            return _token_logprobs(self.model, tokens.to(self.device), lengths.to(self.device), temperature, with_entropy,
                                   entropy_grad)

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, directory) -> None:
        """HF save_pretrained (LoRA: the adapter only) plus the tokenizer, written by rank 0 from the full state dict
        (gathered from the shards, on CPU), so the checkpoint loads anywhere; a collective call on every rank."""
        state = full_state_dict(self.model)
        if self.me.is_leader:
            self.model.save_pretrained(directory, state_dict=state)
            self.tokenizer.save_pretrained(directory)

    def load_weights(self, directory) -> None:
        """Actor weights from a `save` directory (LoRA: the adapter), into the (sharded) model on every rank."""
        from safetensors.torch import load_file

        if self.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(Path(directory) / "adapter_model.safetensors")))
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
        if self.sharded:
            set_model_state_dict(self.model, loaded, options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(loaded)


def reference_on_actor_device(model, device: torch.device, choice: str, shards: int) -> bool:
    """Whether the frozen reference goes on the actor's device ('auto': when its shard fits with a 20% margin)."""
    if choice != "auto":
        return choice == "actor"
    if device.type != "cuda":
        return device.type == "cpu"  # host memory either way: no copy to move
    free, _ = torch.cuda.mem_get_info(device)
    need = sum(p.numel() * p.element_size() for p in model.parameters()) / shards
    return free > 1.2 * need


def _token_logprobs(model, tokens: Tensor, lengths: Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool = False):
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2) - log_norm
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = logits if entropy_grad else logits.detach()
            entropy = torch.logsumexp(source, dim=-1) - (torch.softmax(source, dim=-1) * source).sum(-1)
    return logp, entropy


def sample(logits: Tensor, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
    """Sample one token per row from temperature-scaled logits [B, V] with optional top-k / nucleus filtering."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and probs.device.type != generator.device.type:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _right_pad(prompt_ids: list[list[int]], new_tokens: Tensor, new_logps: Tensor, stop_ids: Tensor, pad_id: int) -> Rollout:
    """Assemble right-padded [prompt, response, pad] rows; the response ends at (and includes) the first stop token."""
    B, N = new_tokens.shape
    is_eos = torch.isin(new_tokens, stop_ids)
    is_end = is_eos.any(1)
    first_eos = torch.where(is_end, is_eos.float().argmax(1), torch.full((B,), N - 1))
    response_lengths = first_eos + 1
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids])
    lengths = prompt_lengths + response_lengths
    L = int(lengths.max())
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    sample_logprobs = torch.zeros((B, L - 1))
    for i, ids in enumerate(prompt_ids):
        p, r = len(ids), int(response_lengths[i])
        tokens[i, :p] = torch.tensor(ids)
        tokens[i, p:p + r] = new_tokens[i, :r]
        sample_logprobs[i, p - 1:p - 1 + r] = new_logps[i, :r]
    return Rollout(tokens, prompt_lengths, lengths, is_end, sample_logprobs)
