"""The rollout-engine interface: sample a `Rollout` of n responses per prompt; take the actor's new weights after each
update. Engines: `native` (models/engines/native.py: our KV-cache sampling loop on the actor's own module) and `vllm`
(models/engines/vllm.py: the vLLM rollout server, which holds its own copy of the weights).

Words: a *rollout* is a batch of sampled responses (`Rollout`) and the phase of the step that makes it; an *engine*
is what samples it for the step; the *rollout server* is the process the vllm engine samples from.

Layouts: prompts go in as token ids; a `Rollout` is right-padded (prompt, response, pad), which is also the critic
server's wire layout. Per-token tensors are [B, L-1] over actions: entry t scores tokens[:, t+1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import torch
from torch import Tensor


@dataclass
class Rollout:
    """A batch of sampled sequences, right-padded: n consecutive rows per prompt."""

    tokens: Tensor  # [B, L] int64: prompt, response (its stop token included), pad
    prompt_lengths: Tensor  # [B]
    lengths: Tensor  # [B] prompt + response
    is_end: Tensor  # [B] bool: the response ended with a stop token before max_new_tokens
    # [B, L-1] the behaviour policy's logprob of each sampled token, 0 off the response: the log-probability under the
    # distribution the engine actually sampled from (temperature, top-k and top-p applied), by whichever weights the
    # engine held (an engine with its own copy: the version it sampled with). With greedy decoding (temperature 0):
    # under the untempered distribution.
    sample_logprobs: Tensor
    # [B] int64: the weights version each row was sampled with (an engine with its own copy)
    versions: Tensor | None = None
    # [B, L-1] float, 1 where tokens[:, t+1] was sampled by the model: a multi-turn episode's response also holds the
    # environment's replies (models/environments/), which carry no loss, no KL and no logprob. None: every response
    # token was sampled (a single-turn rollout)
    model_tokens: Tensor | None = None

    @property
    def response_mask(self) -> Tensor:
        """[B, L-1] float, 1 where tokens[:, t+1] belongs to the response."""
        positions = torch.arange(1, self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
        return ((positions >= self.prompt_lengths.unsqueeze(1)) & (positions < self.lengths.unsqueeze(1))).float()

    @property
    def loss_mask(self) -> Tensor:
        """[B, L-1] float, 1 where tokens[:, t+1] is a model-sampled token: what the losses, the advantages, the KL,
        the entropy and the metrics count (the response mask of a single-turn rollout)."""
        return self.response_mask if self.model_tokens is None else self.model_tokens

    @property
    def response_lengths(self) -> Tensor:
        return self.lengths - self.prompt_lengths

    @property
    def sampled_lengths(self) -> Tensor:
        """[B] the model-sampled tokens of each response (its length, single-turn)."""
        return self.response_lengths if self.model_tokens is None else self.model_tokens.sum(1).long()

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Weights:
    """The actor's full weights for an engine with its own copy: what comes (`specs`: name, dtype, shape, in order,
    known before anything is gathered) and the tensors, one at a time. Iterating may be a collective (gathering FSDP2
    shards): every rank iterates in step. Iterating yields (name, tensor) pairs."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    tensors: Iterable[Tensor]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return zip((name for name, _, _ in self.specs), self.tensors)

    def cast(self, dtype: torch.dtype | None) -> "Weights":
        """The same weights with floating-point tensors in `dtype` (None: as they are), cast one at a time."""
        if dtype is None:
            return self
        specs = [(name, dtype if d.is_floating_point else d, shape) for name, d, shape in self.specs]
        return Weights(specs, (t.to(dtype) if t.is_floating_point() else t for t in self.tensors))


class RolloutEngine(Protocol):
    """What the training step needs from whatever generates the rollouts.

    `generate` is called on every actor rank with that rank's prompts and returns `n` samples of each, consecutive
    (an engine may serve all ranks from rank 0). `update_weights` receives the actor's full weights after each
    update (`Weights`: in the actor's Hugging Face names, one tensor at a time, gathered from the FSDP2 shards, LoRA
    merged, tied lm_head included); it is called on every rank, in step, because gathering a shard is a collective.
    An engine that samples with the actor's own module (`shares_actor_weights`) needs no copy and is never called.
    """

    name: str
    shares_actor_weights: bool

    def generate(self, prompt_ids: list[list[int]], n: int, sampling,
                 generator: torch.Generator | None = None) -> Rollout: ...

    def update_weights(self, weights: Weights) -> None: ...

    def close(self) -> None: ...


class SampleError(ValueError):
    """An engine's samples break the contract (a stop token inside a response, a response that neither ended nor
    reached max_new_tokens, logprobs that do not match the tokens)."""


def check_samples(responses: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], is_end: Sequence[bool],
                  stop_ids: Tensor, max_new_tokens: int) -> None:
    """What a rollout relies on, checked for an engine's own answer: a response ends at (and keeps) its first stop
    token when `is_end`, else it runs to max_new_tokens without one; one logprob per token."""
    stops = set(int(t) for t in stop_ids)
    for i, (ids, lps, end) in enumerate(zip(responses, logprobs, is_end)):
        where = f"sample {i}"
        if len(lps) != len(ids) or not ids:
            raise SampleError(f"{where}: {len(ids)} tokens and {len(lps)} logprobs (one per token, at least one)")
        if any(t in stops for t in ids[:-1]):
            raise SampleError(f"{where}: a stop token before its last token")
        if end and ids[-1] not in stops:
            raise SampleError(f"{where}: is_end, but its last token {ids[-1]} is no stop token {sorted(stops)}")
        if not end and (ids[-1] in stops or len(ids) != max_new_tokens):
            raise SampleError(f"{where}: not is_end, but it has {len(ids)} of max_new_tokens={max_new_tokens} tokens"
                              + (" and ends with a stop token" if ids[-1] in stops else ""))


def from_responses(prompt_ids: Sequence[Sequence[int]], responses: Sequence[Tensor], logprobs: Sequence[Tensor],
                   is_end: Sequence[bool], pad_id: int, versions: Sequence[int] | None = None,
                   model_tokens: Sequence[Sequence[int]] | None = None) -> Rollout:
    """Right-padded [prompt, response, pad] rows of a rollout from each row's prompt, response tokens (its stop token
    kept), their logprobs, and whether it ended; pad tokens never enter a response, whatever the pad id is.
    `model_tokens`: per response token, 1 when the model sampled it (a multi-turn episode's environment tokens: 0)."""
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids])
    lengths = prompt_lengths + torch.tensor([len(r) for r in responses])
    L = int(lengths.max())
    tokens = torch.full((len(prompt_ids), L), pad_id, dtype=torch.long)
    sample_logprobs = torch.zeros((len(prompt_ids), L - 1))
    mask = torch.zeros((len(prompt_ids), L - 1)) if model_tokens is not None else None
    for i, (ids, response, lps) in enumerate(zip(prompt_ids, responses, logprobs)):
        p, r = len(ids), len(response)
        tokens[i, :p] = torch.as_tensor(ids)
        if r:
            tokens[i, p:p + r] = torch.as_tensor(response)
            sample_logprobs[i, p - 1:p - 1 + r] = torch.as_tensor(lps, dtype=torch.float32)
            if mask is not None:
                mask[i, p - 1:p - 1 + r] = torch.as_tensor(model_tokens[i], dtype=torch.float32)
    return Rollout(tokens, prompt_lengths, lengths, torch.as_tensor(list(is_end), dtype=torch.bool), sample_logprobs,
                   torch.as_tensor(list(versions), dtype=torch.long) if versions is not None else None, mask)
