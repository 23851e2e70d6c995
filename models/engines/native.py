"""The `native` rollout engine: batched KV-cache sampling on the actor's own module (no copy, so no weight sync).

Prompts are left-padded; each row stops at its first stop token (EOS and every end-of-turn id the model declares);
all rows stop together once every row has ended on every rank (with FSDP each decoding step is a collective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.distributed import SINGLE, Dist
from models.loading import autocast
from models.engines.base import Rollout, from_responses


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token ids right-aligned in one (rows, longest) tensor, and their attention mask (0 over the padding)."""
    B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, P - len(ids):] = torch.tensor(ids)
        attention[i, P - len(ids):] = 1
    return input_ids, attention


class NativeEngine:
    name = "native"
    shares_actor_weights = True

    def __init__(self, model, pad_id: int, stop_ids: Tensor, device: torch.device, dtype: str = "float32",
                 me: Dist = SINGLE):
        self.model, self.pad_id, self.stop_ids = model, pad_id, stop_ids
        self.device, self.dtype, self.me = device, dtype, me

    @classmethod
    def for_policy(cls, policy, rollout=None) -> "NativeEngine":
        return cls(policy.model, policy.pad_id, policy.stop_ids, policy.device, policy.dtype, policy.me)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling,
                 generator: torch.Generator | None = None) -> Rollout:
        """`n` samples of each prompt (consecutive rows) at `sampling.temperature` (0: greedy), top-k / top-p
        filtered; each sampled token's logprob is that of the distribution it was drawn from (filters applied)."""
        model = self.model
        was_training = model.training
        model.eval()
        if min(len(p) for p in prompt_ids) == 0:
            raise ValueError("prompts: every prompt must have at least one token")
        rows = [p for p in prompt_ids for _ in range(n)]
        input_ids, attention = (t.to(self.device) for t in left_pad(rows, self.pad_id))
        B = input_ids.shape[0]
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        new_tokens, new_logps = [], []
        past, step_input, position = None, input_ids, (attention.cumsum(1) - 1).clamp(min=0)
        for _ in range(sampling.max_new_tokens):
            with autocast(self.device, self.dtype):
                out = model(input_ids=step_input, attention_mask=attention, position_ids=position,
                            past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float() / (sampling.temperature or 1.0)
            if sampling.temperature == 0:  # greedy (held-out eval, eval.temperature=0)
                logps = torch.log_softmax(logits, dim=-1)
                next_token = logits.argmax(-1)
            else:
                logits = filtered(logits, sampling.top_k, sampling.top_p)
                logps = torch.log_softmax(logits, dim=-1)
                next_token = sample(logits, generator)
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
        tokens, logps = torch.stack(new_tokens, 1).cpu(), torch.stack(new_logps, 1).cpu()
        # a row ends at (and keeps) its first stop token; rows that finished early are padded after it
        is_stop = torch.isin(tokens, self.stop_ids)
        is_end = is_stop.any(1)
        ends = torch.where(is_end, is_stop.float().argmax(1) + 1, torch.full((B,), tokens.shape[1]))
        return from_responses(rows, [tokens[i, :e] for i, e in enumerate(ends.tolist())],
                              [logps[i, :e] for i, e in enumerate(ends.tolist())], is_end.tolist(), self.pad_id)

    def update_weights(self, weights) -> None:
        """Nothing to do: the engine samples with the actor's module itself."""

    def close(self) -> None:
        pass


def filtered(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Temperature-scaled logits [B, V] with top-k / nucleus filtering applied (filtered tokens at -inf)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from (filtered) logits [B, V]."""
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and probs.device.type != generator.device.type:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
