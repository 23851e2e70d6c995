"""A causal LM's log-probabilities of given tokens: the policy's scoring pass (models/policy.py), and on-policy
distillation's teacher (loaded frozen, scored in micro-batches) in the trainer's process or in the reward server.
Light next to the actor's code: a reward server imports it without the policy, the loop or FSDP."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from models.loading import DTYPES, disable_dropout, freeze, from_pretrained


def token_logprobs(model, tokens: Tensor, lengths: Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool = False):
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    # no KV cache: a scoring pass never decodes further (and a cache would keep every layer's keys and values)
    logits = model(input_ids=tokens, attention_mask=attention_mask,
                   use_cache=False).logits[:, :-1].float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2) - log_norm
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = logits if entropy_grad else logits.detach()
            entropy = torch.logsumexp(source, dim=-1) - (torch.softmax(source, dim=-1) * source).sum(-1)
    return logp, entropy


def load_teacher(path: str, dtype: str = "float32", device: str | torch.device = "cpu", field: str = "model.teacher"):
    """On-policy distillation's teacher: a frozen causal LM (AutoModelForCausalLM), every weight from its checkpoint."""
    model, info = from_pretrained(AutoModelForCausalLM, path, field, dtype=DTYPES[dtype], output_loading_info=True)
    if info.get("missing_keys"):
        raise ValueError(f"{field}: teacher '{path}' loads with newly initialised weights "
                           f"{sorted(info['missing_keys'])}: a teacher must be a causal LM saved whole")
    return freeze(disable_dropout(model)).to(device)


def teacher_logprobs(model, tokens: torch.Tensor, lengths: torch.Tensor, temperature: float = 1.0,
                     micro_batch_size: int = 64) -> torch.Tensor:
    """[B, L-1] the teacher's log-probability of each next token of right-padded `tokens` (0 past a row's length),
    at the sampling temperature (the student's logprobs are taken at the same), in micro-batches."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for start in range(0, tokens.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            logp, _ = token_logprobs(model, tokens[rows].to(device), lengths[rows].to(device), temperature, False)
            positions = torch.arange(1, tokens.shape[1], device=device).unsqueeze(0)
            out.append((logp * (positions < lengths[rows].to(device).unsqueeze(1))).float().cpu())
    return torch.cat(out) if out else torch.zeros((0, max(tokens.shape[1] - 1, 0)))
