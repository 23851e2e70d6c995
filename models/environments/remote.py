"""Episodes played by someone else's code: a verifiers environment (components/verifiers/) plays every rank's rows
against the run's rollout server and answers one rollout record per row (components/verifiers/worker.py's schema:
token ids, loss mask and logprobs of each turn as the server sampled them, the conversation, the rubric's reward).

Rank 0 gathers the rows of every rank, hands them to `source` (set by the run's services once the rollout server
holds the actor's weights: components/serving/services.py) and scatters the records back; each rank turns its own
into the same `Episode`s and `Played` batch that models/environments/episodes.py's runner makes, so the step, the
eval, the metrics and the sample table treat both alike. A record that failed (the environment raised, the
rollout's turns are not one token sequence) keeps its tokens for the table, scores 0 and is left out of the loss.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Callable

import torch

from models.distributed import SINGLE, Dist
from models.environments.episodes import Episode, Played, played

# rows (every rank's, in rank order) and the sampling arguments -> one record per row, in order
Source = Callable[[list[dict], dict], list[dict]]


def openai_message(message: dict) -> dict:
    """A message with its tool calls as OpenAI's JSON objects (verifiers keeps each as a JSON string)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {**message, "tool_calls": [tool_call(c) for c in calls]}


def tool_call(call) -> dict:
    if not isinstance(call, str):
        return call
    try:
        return json.loads(call)
    except json.JSONDecodeError:
        return {"function": {"name": None, "arguments": call}}


def episode_of(name: str, row: dict, record: dict) -> Episode:
    """A rollout record as an Episode of `name`: its one token sequence (the model's turns, mask 1 and the
    server's logprobs; the environment's replies between them, mask 0), its conversation, how it ended, its reward."""
    prompt = row.get("prompt")
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    episode = Episode(name, f"{name}#{record.get('example_id')}", 0, row, messages, [])
    samples, steps = record.get("samples") or [], record.get("steps") or []
    if samples:
        first = samples[0]
        episode.prompt_ids, episode.ids = list(first["prompt_ids"]), list(first["completion_ids"])
        episode.mask = list(first["completion_mask"])
        episode.logprobs = [float(x) for x in first["completion_logprobs"]]
    episode.completion = [openai_message(m) for m in list(record.get("messages") or [])[len(messages):]]
    assistant = [m for m in episode.completion if m.get("role") == "assistant"]
    episode.turns = int(record.get("turns") or len(steps))
    episode.tool_calls = sum(len(m.get("tool_calls") or []) for m in assistant)
    episode.rounds = sum(bool(m.get("tool_calls")) for m in assistant)
    episode.is_end = bool(steps) and not steps[-1].get("is_truncated", False)
    stop = str(record.get("stop_condition") or "")
    episode.end = "length" if record.get("is_truncated") else "max_turns" if "max_turns" in stop else "stop"
    episode.values = [float(record.get("reward") or 0.0)]
    if record.get("error"):
        episode.fail("error", str(record["error"]))
    elif len(samples) != 1:
        episode.fail("error", f"its {len(steps)} turns are {len(samples)} token sequences, not one: a turn's prompt "
                              f"ids did not extend the previous turn's prompt + completion ids (messages in: the "
                              f"server re-rendered the text); left out of the loss")
    if episode.failed:
        episode.values = [math.nan]
    episode.score = 0.0 if episode.failed else episode.values[0]
    return episode


class RemoteEpisodes:
    """What `state.episodes` is in a verifiers run, on every rank: `play` as models/environments/episodes.py's
    runner, the rows played on rank 0 by `source`."""

    def __init__(self, name: str, tokenizer, me: Dist = SINGLE):
        self.names, self.tokenizer, self.me = [name], tokenizer, me
        self.source: Source | None = None  # rank 0: set by the run's services

    def play(self, engine, rows: list[dict], sampling, generator: torch.Generator | None, max_new_tokens: int,
             pad_id: int) -> Played:
        everyone = self.me.gather_object(rows)
        shares = None
        if self.me.is_leader:
            if self.source is None:
                raise RuntimeError("environment.verifiers: no rollout source: the rollout server was not connected "
                                   "to this run's episodes")
            args = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": max_new_tokens}
            if sampling.top_k:
                args["extra_body"] = {"top_k": sampling.top_k}
            records = self.source([row for mine in everyone for row in mine], args)
            if len(records) != sum(map(len, everyone)):
                raise RuntimeError(f"environment.verifiers: {len(records)} rollouts answered for "
                                   f"{sum(map(len, everyone))} rows")
            bounds = list(itertools.accumulate(map(len, everyone), initial=0))
            shares = [(records[a:b], engine.version) for a, b in zip(bounds, bounds[1:])]
        mine, version = self.me.scatter_object(shares)
        episodes = [episode_of(self.names[0], row, record) for row, record in zip(rows, mine)]
        for episode in episodes:  # failed before its first turn: the prompt as the policy's template renders it
            if not episode.prompt_ids:
                text = self.tokenizer.apply_chat_template(episode.messages, tokenize=False, add_generation_prompt=True)
                episode.prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return played(episodes, self.tokenizer, pad_id, version, 1)

    def close(self) -> None:
        pass
