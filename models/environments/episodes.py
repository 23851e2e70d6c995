"""Multi-turn episodes on one actor rank: the model's turns sampled by the run's rollout engine, the environments'
replies from the worker pool, every token accounted for.

An episode (TRL 1.16's tool loop, in token ids throughout):

    reset(**row) on its environment instance; the observation, if any, ends the row's last user message
    prompt ids = the messages rendered with the environment's tool schemas (models/environments/chat.py)
    repeat: the engine samples a turn from prompt + completion so far (model tokens: loss mask 1, their logprobs)
            the turn is read as a message; no tool call (or a malformed one): the episode ends
            the tool calls run in the episode's worker; their results, rendered as tool messages, are appended as
            the template's suffix ids (environment tokens: loss mask 0, no logprob)
    until: no tool call, environment.max_turns rounds of tool calls, or generation.max_new_tokens (the budget of
           the whole completion, model and environment tokens, as TRL's max_completion_length; a tool reply that
           does not fit ends the episode before it, TRL's rule) or the model's position limit
    then every reward function and the environment's get_reward score it (in its worker); the score is their
    weighted sum, NaN (None) terms left out (TRL's nansum)

Every rank calls the engine the same number of times per wave (a rank with no episode left runs a dummy prompt and
drops the answer): the vLLM engine gathers every rank's prompts on rank 0, and with FSDP every decoding step is a
collective. An episode whose environment or reward fails (an exception, a dead worker, a deadline) scores 0, is
counted (env/errors, env/timeouts), keeps its tokens for the sample table and is left out of the loss (mask 0): the
failure was not the model's. Episodes of an environment that serves one session at a time run one per wave.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from models.distributed import SINGLE, Dist
from models.engines.base import Rollout, from_responses
from models.environments.chat import ChatFormat, read_template
from models.environments.pool import Request, WorkerPool
from models.resolve import fetch_file
from models.specs import absolute_spec, is_file_spec, spec_file

LOG = logging.getLogger("rlhf.environments")

ENDS = ("stop", "length", "max_turns", "overlong", "error", "timeout")


@dataclass
class Episode:
    env: str  # its environment's name ("" for the single factory)
    key: str  # its instance
    worker: int
    row: dict  # what reset(**row) gets: the data set row, its prompt included
    messages: list[dict]  # the prompt's messages (after reset's observation)
    tools: list[dict]
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the completion: model and environment tokens
    mask: list[int] = field(default_factory=list)  # 1 on model tokens
    logprobs: list[float] = field(default_factory=list)  # 0 on environment tokens
    completion: list[dict] = field(default_factory=list)  # its assistant and tool messages (TRL's completions)
    turns: int = 0  # model turns
    rounds: int = 0  # rounds of tool calls answered
    tool_calls: int = 0
    tool_failures: int = 0
    is_end: bool = False  # its last model turn ended with a stop token
    end: str | None = None  # one of ENDS once it ended
    error: str = ""
    env_seconds: float = 0.0  # spent in its environment's calls
    values: list[float] = field(default_factory=list)  # each reward term (NaN: not scored by it)
    score: float = 0.0
    pending: list[dict] = field(default_factory=list)  # tool calls to run
    turn_start: int | None = None  # where the turn being sampled started (in prompt + completion)

    @property
    def failed(self) -> bool:
        return self.end in ("error", "timeout")

    def fail(self, status: str, error: str) -> None:
        self.end, self.error = ("timeout" if status == "timeout" else "error"), error


@dataclass
class Played:
    """A batch of episodes as the training step needs them."""

    episodes: list[Episode]
    rollout: Rollout
    responses: list[str]  # each completion's text (special tokens skipped)
    scores: torch.Tensor  # [B]
    values: torch.Tensor  # [B, F] each reward term (NaN where a term did not score the episode)


def played(episodes: list[Episode], tokenizer, pad_id: int, version: int | None, terms: int) -> Played:
    """Scored episodes as the training step needs them: the rollout in the engine layout (a failed episode's mask
    all 0: the failure was not the model's), each completion's text, the scores and the `terms` reward terms."""
    rollout = from_responses([e.prompt_ids for e in episodes], [e.ids for e in episodes],
                             [e.logprobs for e in episodes], [e.is_end for e in episodes], pad_id,
                             [version] * len(episodes) if version is not None else None,
                             [[0] * len(e.ids) if e.failed else e.mask for e in episodes])
    responses = [tokenizer.decode(e.ids, skip_special_tokens=True) for e in episodes]
    values = torch.tensor([e.values for e in episodes], dtype=torch.float64).reshape(len(episodes), terms)
    scores = torch.tensor([e.score for e in episodes], dtype=torch.float64)
    return Played(episodes, rollout, responses, scores, values)


class EpisodeRunner:
    """This rank's environments: the worker pool (instances pooled and reused across batches, as TRL does), the
    environments' tools, and the chat format."""

    def __init__(self, pool: WorkerPool, environments: dict, chat: ChatFormat, reward_names: list[str],
                 reward_weights: list[float], max_turns: int | None, call_deadline_s: float,
                 episode_deadline_s: float, position_limit: int | None = None, me: Dist = SINGLE):
        self.pool, self.environments, self.chat = pool, environments, chat
        self.max_turns = max_turns
        self.call_deadline_s, self.episode_deadline_s = call_deadline_s, episode_deadline_s
        self.position_limit, self.me = position_limit, me
        # the reward terms: the reward functions, then each environment class with get_reward (weight 1, its name)
        self.env_rewards = list(dict.fromkeys(e["class"] for e in environments.values() if e["has_reward"]))
        self.names = list(reward_names) + self.env_rewards
        self.weights = list(reward_weights) + [1.0] * len(self.env_rewards)
        self.functions = len(reward_names)

    # ------------------------------------------------------------------------------------------------ the batch
    def episodes(self, rows: list[dict]) -> list[Episode]:
        """One episode per row; instance j of an environment in this batch is its pooled instance j."""
        used: dict[str, int] = {}
        out = []
        for row in rows:
            env = "" if "" in self.environments else str(row.get("environment") or "")
            if env not in self.environments:
                raise ValueError(f"environment.factory: a row asks for the environment {env!r}; the run has "
                                 f"{sorted(self.environments)}")
            j = used.get(env, 0)
            used[env] = j + 1
            prompt = row.get("prompt")
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                        [dict(m) for m in prompt] if prompt else [{"role": "user", "content": ""}])
            reset_row = {k: v for k, v in row.items() if k != "environment"} if env else dict(row)
            out.append(Episode(env, f"{env}#{j}", j % self.pool.size, reset_row, messages,
                               self.environments[env]["tools"]))
        return out

    def waves(self, episodes: list[Episode]) -> list[list[Episode]]:
        """The episodes of concurrent environments together, each of a one-session environment alone."""
        alone = {name for name, e in self.environments.items() if e.get("concurrent") is False}
        together = [e for e in episodes if e.env not in alone]
        return ([together] if together else []) + [[e] for e in episodes if e.env in alone]

    def play(self, engine, rows: list[dict], sampling, generator: torch.Generator | None, max_new_tokens: int,
             pad_id: int) -> Played:
        """Every row's episode to its end, then scored; the rollout in the engine layout with its loss mask."""
        episodes = self.episodes(rows)
        waves = self.waves(episodes)
        count = int(self.me.all_reduce(torch.tensor(len(waves)), op="max")) if self.me.active else len(waves)
        version = None
        for w in range(count):
            version = self._play(waves[w] if w < len(waves) else [], engine, sampling, generator, max_new_tokens,
                                 episodes) or version
        self._score(episodes)
        return played(episodes, self.chat.tokenizer, pad_id, version, len(self.names))

    # ------------------------------------------------------------------------------------------------ one wave
    def _play(self, episodes: list[Episode], engine, sampling, generator, max_new_tokens: int,
              everyone: list[Episode]) -> int | None:
        self._reset(episodes)
        version = None
        while True:
            active = [e for e in episodes if e.end is None]
            if self.me.active:
                if int(self.me.all_reduce(torch.tensor(len(active)), op="max")) == 0:
                    break
            elif not active:
                break
            budgets = [self._budget(e, max_new_tokens) for e in active]
            contexts = [e.prompt_ids + e.ids for e in active] or [everyone[0].prompt_ids]  # none left here: a dummy
            # one length for every rank's turns (one request on rank 0), no longer than any context has room for
            # (the engine's position limit): a turn it cuts before its own budget goes on at the next call
            longest = max(budgets, default=1)
            room = (min((self.position_limit - len(c) for c in contexts), default=longest) if self.position_limit
                    else longest)
            if self.me.active:
                longest = int(self.me.all_reduce(torch.tensor(longest), op="max"))
                room = int(self.me.all_reduce(torch.tensor(room), op="min"))
            turn = sampling.model_copy(update={"max_new_tokens": max(min(longest, room), 1)})
            rollout = engine.generate(contexts, 1, turn, generator)
            if rollout.versions is not None:
                version = int(rollout.versions[0])
            for i, (episode, budget) in enumerate(zip(active, budgets)):
                start, end = int(rollout.prompt_lengths[i]), int(rollout.lengths[i])
                ids = rollout.tokens[i, start:end].tolist()[:budget]
                logprobs = rollout.sample_logprobs[i, start - 1:end - 1].tolist()[:budget]
                ended = bool(rollout.is_end[i]) and int(end - start) <= budget
                self._sampled(episode, ids, logprobs, ended, len(ids) >= budget, contexts[i])
            self._tools([e for e in active if e.pending], max_new_tokens)
        return version

    def _budget(self, episode: Episode, max_new_tokens: int) -> int:
        budget = max_new_tokens - len(episode.ids)
        if self.position_limit:
            budget = min(budget, self.position_limit - len(episode.prompt_ids) - len(episode.ids))
        return max(budget, 1)

    def _reset(self, episodes: list[Episode]) -> None:
        answers = self.pool.run([Request(e.worker, {"op": "reset", "key": e.key, "env": e.env, "row": e.row},
                                         min(self.call_deadline_s, self.episode_deadline_s), e.key)
                                 for e in episodes])
        for episode, answer in zip(episodes, answers):
            episode.env_seconds += answer.seconds
            if answer.status != "ok":
                episode.fail(answer.status, f"reset: {answer.error}")
            elif answer.result is not None:  # TRL: appended to the last message, no separator
                last = episode.messages[-1]
                episode.messages[-1] = {**last, "content": str(last.get("content") or "") + answer.result}
            episode.prompt_ids = self.chat.prompt_ids(episode.messages, episode.tools)
            if self.position_limit and len(episode.prompt_ids) >= self.position_limit and episode.end is None:
                episode.fail("error", f"the prompt has {len(episode.prompt_ids)} tokens, the model's position limit "
                                      f"is {self.position_limit}")

    def _sampled(self, episode: Episode, ids: list[int], logprobs: list[float], ended: bool, spent: bool,
                 context: list[int]) -> None:
        """A turn's ids from one engine call: kept (mask 1, their logprobs); a turn that ended is read as a message
        (its prefix: the context it started from); one that spent the episode's budget ends it; one the engine cut
        shorter goes on at the next call."""
        if episode.turn_start is None:
            episode.turn_start = len(context)
        episode.ids += ids
        episode.mask += [1] * len(ids)
        episode.logprobs += logprobs
        episode.is_end = ended
        if not ended and not spent:
            return
        prefix = (episode.prompt_ids + episode.ids)[:episode.turn_start]
        turn = (episode.prompt_ids + episode.ids)[episode.turn_start:]
        episode.turn_start = None
        episode.turns += 1
        message = self.chat.parse(turn, prefix, episode.tools)
        episode.completion.append(message)
        if not ended:
            episode.end = "length"
        elif not message.get("tool_calls"):
            episode.end = "stop"
        elif self.max_turns is not None and episode.rounds >= self.max_turns:
            episode.end = "max_turns"
        else:
            episode.pending = message["tool_calls"]

    def _tools(self, episodes: list[Episode], max_new_tokens: int) -> None:
        """Each episode's tool calls in its worker (the workers in parallel), then its tool messages as suffix ids."""
        requests, owners = [], []
        for episode in episodes:
            for call in episode.pending:
                episode.tool_calls += 1
                function = call.get("function", {}) if call.get("type", "function") == "function" else None
                if function is None:
                    continue
                left = self.episode_deadline_s - episode.env_seconds
                requests.append(Request(episode.worker, {"op": "call", "key": episode.key, "name": function["name"],
                                                         "arguments": function.get("arguments", {})},
                                        max(min(self.call_deadline_s, left), 1e-3), episode.key))
                owners.append(episode)
        answers = iter(self.pool.run(requests))
        for episode in episodes:
            messages = []
            for call in episode.pending:
                if call.get("type", "function") != "function":
                    episode.tool_failures += 1
                    messages.append({"role": "tool", "name": call.get("name", "unknown"),
                                     "content": str({"error": f"Unsupported tool call type: {call.get('type')}"})})
                    continue
                answer = next(answers)
                episode.env_seconds += answer.seconds
                if answer.status != "ok":
                    if episode.end is None:
                        episode.fail(answer.status, f"tool {call['function']['name']}: {answer.error}")
                    continue
                episode.tool_failures += int(answer.result["failed"])
                messages.append({"role": "tool", "name": call["function"]["name"], "content": answer.result["content"]})
            episode.pending = []
            if episode.end is not None:
                continue
            if episode.env_seconds > self.episode_deadline_s:
                episode.fail("timeout", f"the episode's environment calls took {episode.env_seconds:.3g} s, past "
                                        f"environment.episode_deadline_s={self.episode_deadline_s:g}")
                continue
            suffix = self.chat.suffix_ids(messages)
            total = len(episode.prompt_ids) + len(episode.ids) + len(suffix)
            if len(episode.ids) + len(suffix) >= max_new_tokens or (self.position_limit
                                                                    and total >= self.position_limit):
                episode.end = "overlong"  # TRL: the tool reply is dropped, the completion ends as it is
                continue
            episode.completion += messages
            episode.ids += suffix
            episode.mask += [0] * len(suffix)
            episode.logprobs += [0.0] * len(suffix)
            episode.rounds += 1

    # ------------------------------------------------------------------------------------------------ scoring
    def _score(self, episodes: list[Episode]) -> None:
        """Every reward term of every episode that did not fail, in its worker; the score their weighted nansum."""
        for episode in episodes:
            episode.values = [math.nan] * len(self.names)
        by_worker: dict[int, list[Episode]] = {}
        for episode in episodes:
            if not episode.failed and not self.pool.holds(episode.worker, episode.key):
                episode.fail("error", "its environment instance was lost: its worker was killed or died during "
                                      "another episode's call")
            if not episode.failed:
                by_worker.setdefault(episode.worker, []).append(episode)
        requests = []
        for worker, mine in by_worker.items():
            requests.append(Request(worker, {
                "op": "rewards", "keys": [e.key for e in mine],
                "columns": [{k: v for k, v in e.row.items() if k != "prompt"} for e in mine],
                "prompts": [e.messages for e in mine], "completions": [e.completion for e in mine],
                "completion_ids": [e.ids for e in mine],
                "prompt_texts": [self.chat.tokenizer.decode(e.prompt_ids, skip_special_tokens=True) for e in mine],
                "completion_texts": [self.chat.tokenizer.decode(e.ids, skip_special_tokens=True) for e in mine]},
                self.call_deadline_s))
        for (worker, mine), answer in zip(by_worker.items(), self.pool.run(requests)):
            if answer.status != "ok":
                for episode in mine:
                    episode.fail(answer.status, f"scoring: {answer.error}")
                continue
            for j, episode in enumerate(mine):
                problems = []
                for f, outcome in enumerate(answer.result["functions"]):
                    if "error" in outcome:
                        problems.append(f"reward function {self.names[f]}: {outcome['error']}")
                    else:
                        value = outcome["values"][j]
                        episode.values[f] = math.nan if value is None else value
                own = answer.result["environments"][j]
                if "error" in own:
                    problems.append(f"{self.environments[episode.env]['class']}.get_reward: {own['error']}")
                elif own["value"] is not None:
                    env_reward = self.env_rewards.index(self.environments[episode.env]["class"])
                    episode.values[self.functions + env_reward] = own["value"]
                if problems:
                    episode.fail("error", "; ".join(problems))
        for episode in episodes:
            episode.score = 0.0 if episode.failed else math.fsum(
                w * v for w, v in zip(self.weights, episode.values) if not math.isnan(v))

    def close(self) -> None:
        self.pool.close()


# ---------------------------------------------------------------- what the step logs

def episode_stats(episodes: list[Episode]) -> torch.Tensor:
    """[B, 4] float64 per episode: tool calls, failed tool calls, model turns, how it ended (index in ENDS); what the
    step gathers from every rank for `episode_metrics`."""
    return torch.tensor([[e.tool_calls, e.tool_failures, e.turns, ENDS.index(e.end) if e.end in ENDS else -1]
                         for e in episodes], dtype=torch.float64).reshape(len(episodes), 4)


def episode_metrics(stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """From `episode_stats` of all ranks: TRL's tool metrics (tools/call_frequency: tool calls per episode,
    tools/failure_frequency: failed calls per call) and ours (env/*: turns, tool use, how episodes ended, errors and
    timeouts counted)."""
    n = max(len(stats), 1)
    calls, failures, turns, ends = stats.T if len(stats) else torch.zeros(4, 1, dtype=torch.float64)
    total = float(calls.sum())
    ended = {end: float((ends == i).sum()) for i, end in enumerate(ENDS)}
    metrics = {"tools/call_frequency": total / n,
               "tools/failure_frequency": float(failures.sum()) / total if total else 0.0,
               "env/turns_mean": float(turns.sum()) / n, "env/turns_max": float(turns.max()) if len(stats) else 0.0,
               "env/tool_use_ratio": float((calls > 0).sum()) / n,
               "env/turn_limit_ratio": ended["max_turns"] / n, "env/overlong_ratio": ended["overlong"] / n,
               "env/errors": ended["error"], "env/timeouts": ended["timeout"]}
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def transcript(episode: Episode) -> str:
    """The conversation after the prompt as one text: each turn on its lines, tool calls and results shown."""
    lines = []
    for message in episode.completion:
        if message.get("role") == "tool":
            lines.append(f"[tool {message.get('name')}] {message.get('content')}")
            continue
        if message.get("content"):
            lines.append(f"[assistant] {message['content']}")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            lines.append(f"[assistant calls {function.get('name')}] {function.get('arguments')}")
    return "\n".join(lines)


def episode_rows(episodes: list[Episode], names: list[str], limit: int = 16) -> list[dict]:
    """Sample-table rows: the prompt's last user message, the whole conversation, turns, tool calls and failures,
    how it ended (and why it failed), each reward term and the score."""
    rows = []
    for episode in episodes[:limit]:
        users = [m for m in episode.messages if m.get("role") == "user"]
        row = {"prompt": str(users[-1].get("content") if users else ""), "conversation": transcript(episode),
               "turns": episode.turns, "tool_calls": episode.tool_calls, "tool_failures": episode.tool_failures,
               "end": episode.end or "", "error": episode.error, "score": float(episode.score)}
        row.update({f"reward/{name}": (None if math.isnan(v) else float(v)) for name, v in zip(names, episode.values)})
        rows.append(row)
    return rows


# ---------------------------------------------------------------- a run's environments

def start_episodes(cfg, tokenizer, model_config, me: Dist = SINGLE, workers: int | None = None) -> EpisodeRunner:
    """The environments of the run `cfg` (an RLHFConfig with environment.factory) on this rank: the worker pool
    started and probed, the environments and the chat format checked (each refusal names its field)."""
    env = cfg.environment
    pool = WorkerPool(workers or env.workers,
                      {name or "": absolute_spec(spec) for name, spec in env.factories().items()},
                      worker_reward_specs(cfg)).start()
    try:
        environments = pool.probe(env.call_deadline_s)
        check_environments(environments, cfg, me)
        chat = ChatFormat(tokenizer, read_template(env.chat_template), getattr(model_config, "model_type", None))
        chat.check("environment.chat_template" if env.chat_template else "model.policy (its tokenizer's chat template)")
    except BaseException:
        pool.close()
        raise
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    return EpisodeRunner(pool, environments, chat, cfg.reward.function_names(), cfg.reward.function_weights(),
                         env.max_turns, env.call_deadline_s, env.episode_deadline_s, limit, me)


def worker_reward_specs(cfg) -> list[str]:
    """The reward functions as the workers load them: a file the run stored a copy of (reward.files) as that copy on
    this machine (checked by its digest), any other file by its absolute path, a module as it is."""
    out = []
    for i, spec in enumerate(cfg.reward.specs()):
        stored = (cfg.reward.files or {}).get(str(spec_file(spec))) if is_file_spec(spec) else None
        if stored is not None:
            path = fetch_file(stored.uri, stored.sha256, f"reward.functions[{i}]", cfg.deploy)
            spec = f"{path}:{spec.rpartition(':')[2]}"
        out.append(absolute_spec(spec))
    return out


def check_environments(environments: dict, cfg, me: Dist = SINGLE) -> None:
    """A reward source exists (reward functions, or an environment's get_reward: TRL's rule); an environment that
    serves one session at a time is refused or serialised as environment.single_session says."""
    if not cfg.reward.specs() and not any(e["has_reward"] for e in environments.values()):
        raise ValueError("reward.functions: an environment run needs a reward source: reward functions, or an "
                         "environment with a get_reward() method; "
                         f"{', '.join(e['class'] for e in environments.values())} has none")
    for name, e in environments.items():
        if e["concurrent"] is not False:
            continue
        where = f"environment.factory{'.' + name if name else ''} ({e['class']})"
        if cfg.environment.single_session == "refuse":
            raise ValueError(f"{where} serves one session at a time (SUPPORTS_CONCURRENT_SESSIONS = False) and "
                             f"environment.single_session='refuse'")
        if me.world_size > 1:
            raise ValueError(f"{where} serves one session at a time (SUPPORTS_CONCURRENT_SESSIONS = False): its "
                             f"episodes can be serialised on one actor rank, not across {me.world_size}")
        LOG.warning("%s serves one session at a time (SUPPORTS_CONCURRENT_SESSIONS = False): its episodes run one "
                    "after another (environment.single_session='serialise')", where)


def check_environment_run(cfg, tokenizer, sources: dict[str, list[str]]) -> None:
    """Before any model loads: the environments load and probe in a worker, the chat template carries tool-calling
    episodes, and every reward function finds the data set columns it reads in each source ({where: columns})."""
    from transformers import AutoConfig  # light next to a model: its config file

    runner = start_episodes(cfg, tokenizer, AutoConfig.from_pretrained(cfg.local_path("model.policy")),
                            workers=1)
    try:
        fields = (["reward.function"] if cfg.reward.function else
                  [f"reward.functions[{i}]" for i in range(len(cfg.reward.specs()))])
        for field, spec, convention in zip(fields, cfg.reward.specs(), runner.pool.conventions):
            for where, columns in sources.items():
                missing = sorted(set(convention["required"]) - set(columns))
                if missing:
                    raise ValueError(f"{field}: '{spec}' needs the column(s) {missing}, which {where} does not "
                                     f"have; its columns besides the prompt: {columns}")
    finally:
        runner.close()
