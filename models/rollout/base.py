"""The rollout-engine interface: sample a `Rollout` from a batch of prompts; take the actor's new weights after each
update. Engines: `native` (models/rollout/native.py: our KV-cache sampling loop on the actor's own module).

Layouts: prompts go in as token ids; a `Rollout` is right-padded (prompt, response, pad), which is also the critic
server's wire layout. Per-token tensors are [B, L-1] over actions: entry t scores tokens[:, t+1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
from torch import Tensor


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


class RolloutEngine(Protocol):
    """What the training step needs from whatever generates the rollouts.

    `generate` is called on every actor rank with that rank's prompts (an engine may serve all ranks from rank 0).
    `update_weights` receives the actor's full weights after each update, as (name, tensor) pairs in the actor's
    Hugging Face names, streamed one parameter at a time (gathered from the FSDP2 shards, LoRA merged); it is called on
    every rank, in step, because gathering a shard is a collective. An engine that samples with the actor's own
    module (`shares_actor_weights`) needs no copy and is never called.
    """

    name: str
    shares_actor_weights: bool

    def generate(self, prompt_ids: list[list[int]], gen, generator: torch.Generator | None = None) -> Rollout: ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None: ...

    def close(self) -> None: ...


def right_pad(prompt_ids: list[list[int]], new_tokens: Tensor, new_logps: Tensor, stop_ids: Tensor, pad_id: int) -> Rollout:
    """Assemble right-padded [prompt, response, pad] rows from generated tokens [B, N] (pad after a row's end) and their
    logprobs; the response ends at (and includes) the first stop token."""
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
