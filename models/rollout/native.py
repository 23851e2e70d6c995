"""The `native` rollout engine: batched KV-cache sampling on the actor's own module (no copy, so no weight sync).

Prompts are left-padded; each row stops at its first stop token (EOS and every end-of-turn id the model declares);
all rows stop together once every row has ended on every rank (with FSDP each decoding step is a collective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.distributed import SINGLE, Dist
from models.loading import autocast
from models.rollout.base import Rollout, right_pad


class NativeEngine:
    name = "native"
    shares_actor_weights = True

    def __init__(self, model, pad_id: int, stop_ids: Tensor, device: torch.device, dtype: str = "float32",
                 me: Dist = SINGLE):
        self.model, self.pad_id, self.stop_ids, self.device, self.dtype, self.me = model, pad_id, stop_ids, device, dtype, me

    @classmethod
    def for_policy(cls, policy, rollout=None) -> "NativeEngine":
        return cls(policy.model, policy.pad_id, policy.stop_ids, policy.device, policy.dtype, policy.me)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], gen, generator: torch.Generator | None = None) -> Rollout:
        """Sample up to `gen.max_new_tokens` tokens per prompt at `gen.temperature` (top-k / top-p filtered);
        sampling-time logprobs are temperature-scaled, before filtering."""
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
            logits = out.logits[:, -1, :].float() / (gen.temperature or 1.0)
            logps = torch.log_softmax(logits, dim=-1)
            next_token = (logits.argmax(-1) if gen.temperature == 0  # greedy (held-out eval, eval.temperature=0)
                          else sample(logits, gen.top_k, gen.top_p, generator))
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
        return right_pad(prompt_ids, torch.stack(new_tokens, 1).cpu(), torch.stack(new_logps, 1).cpu(),
                         self.stop_ids, self.pad_id)

    def update_weights(self, weights) -> None:
        """Nothing to do: the engine samples with the actor's module itself."""

    def close(self) -> None:
        pass


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
