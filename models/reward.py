"""Rewards: a sequence-classification reward model, or Python reward functions.

A function is named 'package.module:function' (imported: it must be importable in the process that scores) or
'path/to/rewards.py:function' (a file, under a module name of its own: no package, no sys.path entry needed). A run
stores the bytes of each such file in its store where it starts (reward.files: its sha256 and stored copy, by the
absolute path it was read from), and every process that scores for it (the reward server wherever it runs, the
actor's rank 0) loads those bytes, checked by their digest, never the path: a file that exists only where the run
started scores everywhere, and a changed reward needs no image rebuild. A process with no stored copy of a file (a
standalone `rlhf serve reward`) loads it by its path. Several functions with weights (reward.functions / reward.weights,
as TRL's reward_funcs / reward_weights) score as their weighted sum; each one's scores travel with it for the metrics
rewards/<name>/mean.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Callable, Optional

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models.deploy import DeployConfig
from models.loading import DTYPES, disable_dropout, freeze, from_pretrained
from models.resolve import fetch_file
from models.specs import import_object, is_file_spec, spec_file

RewardFn = Callable[[list[str], list[str]], list[float]]


REWARD_BOUND = 1e6  # |reward| a reward function may return (models/critic.VALUE_BOUND for the critic's inputs)
STATS = ("reward_mean", "reward_std")  # in a reward model's config.json, written by the reward_model stage


class HandOffError(ValueError):
    """A model that does not load as the next stage needs it (a reward model with a newly initialised weight)."""


def load_reward_model(path: str, dtype: str = "float32", device: str | torch.device = "cpu",
                      field: str = "model.reward",
                      normalize: bool = False):
    """A frozen AutoModelForSequenceClassification with one label (the scalar reward), every weight from its
    checkpoint (check_loaded). `normalize`: its scores become (s - reward_mean) / reward_std, the statistics the
    reward_model stage stored in its config.json (reward.normalize)."""
    model, info = from_pretrained(AutoModelForSequenceClassification, path, field, dtype=DTYPES[dtype],
                                  output_loading_info=True)
    check_loaded(info, path, field)
    if model.config.num_labels != 1:
        raise ValueError(f"{field}: reward model '{path}' has num_labels={model.config.num_labels}, expected 1")
    if normalize:
        model.reward_normalization = stored_stats(model.config, path, field)
    return freeze(disable_dropout(model)).to(device)


def check_loaded(info: dict, path: str, field: str) -> None:
    """A reward model must load every weight from its checkpoint: transformers initialises a missing one (the score
    head of a causal LM's checkpoint, TRL #1379, OpenRLHF #643) or one of another shape at random and only warns,
    and every score would be noise. Refused, naming the weights."""
    fresh = sorted(set(info.get("missing_keys") or ()) | {k if isinstance(k, str) else k[0]
                                                          for k in info.get("mismatched_keys") or ()})
    if fresh:
        raise HandOffError(f"{field}: reward model '{path}' loads with newly initialised weights {fresh}: its "
                           f"checkpoint lacks them (a causal LM saved without its score head?) or holds them in "
                           f"another shape; a reward model must be saved as AutoModelForSequenceClassification with "
                           f"num_labels=1")


def stored_stats(config, path: str, field: str) -> tuple[float, float]:
    """(reward_mean, reward_std) of a reward model's config; refused, naming them, when absent or unusable."""
    mean, std = (getattr(config, name, None) for name in STATS)
    if mean is None or std is None:
        raise ValueError(f"{field}: reward.normalize needs the reward statistics {list(STATS)} in the config.json of "
                         f"'{path}' (the reward_model stage writes them); it has none")
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"{field}: '{path}' stores reward_mean={mean}, reward_std={std}; reward.normalize needs "
                         f"finite values and reward_std > 0")
    return float(mean), float(std)


def _head(model) -> torch.nn.Module:
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return getattr(model, name)
    raise ValueError(f"{type(model).__name__} has no 'score' or 'classifier' head")


@torch.no_grad()
def reward_model_scores(model, tokens: Tensor, lengths: Tensor) -> Tensor:
    """Score [B] read at the last real token (index lengths-1) of right-padded tokens [B, L] (normalised when the
    model was loaded with normalize=True).

    The head is applied to the backbone's hidden states directly, so a pad token equal to EOS cannot shift the
    position that is scored (the pitfall of pooling by pad_token_id).
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    attention_mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).long()
    hidden = model.base_model(input_ids=tokens, attention_mask=attention_mask).last_hidden_state
    last = hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]
    scores = _head(model)(last).squeeze(-1).float()
    stats = getattr(model, "reward_normalization", None)  # load_reward_model(normalize=True)
    return (scores - stats[0]) / stats[1] if stats is not None else scores


def reward_file(spec: str):
    """The file a file spec names, as an absolute, normalised path (models/specs.spec_file)."""
    return spec_file(spec)


def import_function(spec: str, field: str = "reward.function", files: Optional[dict] = None,
                    deploy: Optional[DeployConfig] = None):
    """The object a spec names: 'package.module:fn' imported; 'path/to/rewards.py:fn' loaded from the run's stored
    copy of the file when `files` (reward.files) has one (by its digest, as the module 'rlhf_rewards_<sha256>'),
    else from the path (as 'rlhf_rewards_<hash of the path>'), once per process (models/specs.import_object)."""
    if not is_file_spec(spec):
        return import_object(spec, field)
    origin = reward_file(spec)
    stored = (files or {}).get(str(origin))
    if stored is None:
        if not origin.is_file():
            raise ValueError(f"{field}: reward file '{origin}' does not exist in this process (working directory "
                             f"{os.getcwd()}), and the run stored no copy of it (reward.files): a run stores each "
                             f"reward file where it starts, for every process that scores")
        return import_object(spec, field)
    sha256, uri = (stored["sha256"], stored["uri"]) if isinstance(stored, dict) else (stored.sha256, stored.uri)
    try:
        path = fetch_file(uri, sha256, field, deploy)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ValueError(str(exc)) from exc
    return import_object(spec, field, path=path, module_name=f"rlhf_rewards_{sha256[:24]}", sha256=sha256)


def load_reward_function(spec: str, field: str = "reward.function", probe: bool = True, files: Optional[dict] = None,
                         deploy: Optional[DeployConfig] = None) -> RewardFn:
    """Load a reward function (`import_function`) and wrap it so a wrong length or non-finite value fails loudly.

    The function is called as fn(prompts, responses, **columns): the data set's other columns (models/data.py), one
    list per column with a value per sample, for the parameters it names (all of them if it takes **kwargs). A
    function of (prompts, responses) alone gets none. The wrapper takes `columns` as a list of row dicts.

    With `probe`, a function that reads no column is called once on two dummy samples so a broken function fails
    before training starts; `check_columns` checks a data set's columns against what it needs. `files`, `deploy`:
    the run's stored reward files and where to fetch them (`import_function`)."""
    attr = spec.rpartition(":")[2]
    fn = import_function(spec, field, files, deploy)
    if not callable(fn):
        raise ValueError(f"{field}: '{spec}' is not callable")
    required, optional, any_column = column_parameters(fn)

    def checked(prompts: list[str], responses: list[str], columns: list[dict] | None = None) -> list[float]:
        available = sorted({k for row in columns or [] for k in row})
        missing = sorted(required - set(available))
        if missing:
            raise ValueError(f"{field}: '{spec}' needs the column(s) {missing}; the rows have {available}")
        names = available if any_column else sorted((required | optional) & set(available))
        kwargs = {name: [row.get(name) for row in columns] for name in names}
        scores = list(fn(prompts, responses, **kwargs))
        if len(scores) != len(responses):
            raise ValueError(f"{field}: '{spec}' returned {len(scores)} rewards for {len(responses)} responses")
        bad = [i for i, s in enumerate(scores) if not isinstance(s, (int, float)) or not math.isfinite(s)]
        if bad:
            raise ValueError(f"{field}: '{spec}' returned non-finite or non-numeric rewards at indices {bad[:5]}")
        huge = [i for i, s in enumerate(scores) if abs(s) > REWARD_BOUND]
        if huge:
            raise ValueError(f"{field}: '{spec}' returned rewards beyond +-{REWARD_BOUND:g} at indices {huge[:5]} "
                             f"(their squares overflow float32 in the critic's loss)")
        return [float(s) for s in scores]

    def check_columns(names, source: str) -> None:
        """Fail before training when the data set lacks a column the function needs."""
        missing = sorted(required - set(names))
        if missing:
            raise ValueError(f"{field}: '{spec}' needs the column(s) {missing}, which {source} does not have; its "
                             f"columns besides the prompt: {sorted(names)}")

    checked.__name__ = attr
    checked.check_columns = check_columns
    checked.columns = required | optional
    if probe and not required and not any_column:  # fail before training starts, not at the first rollout
        checked(["probe prompt", "probe prompt"], ["probe response", "another response"])
    return checked


class WeightedRewards:
    """Reward functions with weights (reward.functions + reward.weights, or one reward.function): each scores every
    sample; the score is their weighted sum (TRL's reward_funcs / reward_weights). Called like one reward function
    (the score); `score_all` also gives each function's scores, by name (metrics rewards/<name>/mean and /std)."""

    def __init__(self, functions: list[RewardFn], weights: list[float], names: list[str]):
        self.functions, self.weights, self.names = functions, list(weights), list(names)

    def score_all(self, prompts: list[str], responses: list[str],
                  columns: list[dict] | None = None) -> tuple[list[float], list[list[float]]]:
        """(score per sample, [each function's score per sample])."""
        each = [fn(prompts, responses, columns) for fn in self.functions]
        total = [math.fsum(w * s[i] for w, s in zip(self.weights, each)) for i in range(len(responses))]
        return total, each

    def __call__(self, prompts: list[str], responses: list[str], columns: list[dict] | None = None) -> list[float]:
        return self.score_all(prompts, responses, columns)[0]

    @property
    def columns(self) -> set[str]:
        return set().union(*(fn.columns for fn in self.functions))

    def check_columns(self, names, source: str) -> None:
        for fn in self.functions:
            fn.check_columns(names, source)


def load_reward_functions(reward, probe: bool = True, deploy: Optional[DeployConfig] = None) -> WeightedRewards:
    """The reward functions of a RewardConfig (reward.function, or reward.functions with reward.weights), loaded (a
    file the run stored: from its stored copy, fetched with `deploy`'s settings)."""
    specs = reward.specs()
    fields = ["reward.function"] if reward.function else [f"reward.functions[{i}]" for i in range(len(specs))]
    return WeightedRewards([load_reward_function(s, f, probe, reward.files, deploy) for s, f in zip(specs, fields)],
                           reward.function_weights(), reward.function_names())


def column_parameters(fn) -> tuple[set[str], set[str], bool]:
    """(required, optional) column parameters of a reward function beyond its first two, and whether it takes
    **kwargs (every column)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set(), set(), False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    rest = [p for p in params if p not in positional and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = {p.name for p in rest if p.default is p.empty}
    optional = {p.name for p in rest if p.default is not p.empty}
    return required, optional, any(p.kind == p.VAR_KEYWORD for p in params)


# ---------------------------------------------------------------- rewards from text (the reward model's own tokenizer)

def load_reward_tokenizer(path: str, field: str = "model.reward"):
    tokenizer = from_pretrained(AutoTokenizer, path, field)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def encode_pair(tokenizer, prompt: str, response: str, chat_template: bool = False) -> list[int]:
    """Token ids of (prompt, response) for a reward model: its chat template (user, assistant) when asked and it has
    one; otherwise "prompt response" followed by EOS, the layout of a sequence the policy produced."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": response}],
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(f"{prompt} {response}")["input_ids"]
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def text_batch(tokenizer, prompts: list[str], responses: list[str], chat_template: bool = False,
               max_length: int | None = None) -> tuple[Tensor, Tensor]:
    """Right-padded tokens [B, L] and lengths [B] of (prompt, response) pairs; a pair longer than `max_length` keeps
    its last `max_length` tokens (the response and its end are what is scored). With `max_length`, each text first
    keeps only its last `text_char_budget` characters: the tokenizer's work per pair is bounded whatever a request
    sends, and the tokens kept are the same (the budget holds more than `max_length` tokens of any text)."""
    if max_length is not None:
        budget = text_char_budget(tokenizer, max_length)
        prompts, responses = [p[-budget:] for p in prompts], [r[-budget:] for r in responses]
    rows = [encode_pair(tokenizer, p, r, chat_template) for p, r in zip(prompts, responses)]
    if max_length is not None:
        rows = [row[-max_length:] for row in rows]
    lengths = torch.tensor([max(len(row), 1) for row in rows])
    tokens = torch.full((len(rows), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tokens, lengths


def text_char_budget(tokenizer, max_length: int) -> int:
    """Characters of a text that hold more than `max_length` of its tokens, whatever the text: every token covers at
    most as many characters as its longest vocabulary entry has symbols (a byte-level entry has a symbol per byte),
    plus a margin for the token the cut splits."""
    longest = getattr(tokenizer, "_rlhf_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        tokenizer._rlhf_longest_token = longest
    return (max_length + 8) * max(longest, 1)


def reward_limit(model) -> int | None:
    """The longest sequence a reward model scores (its position table)."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)


def text_batches(tokenizer, prompts: list[str], responses: list[str], chat_template: bool = False,
                 max_length: int | None = None, micro_batch_size: int = 64) -> list[tuple[Tensor, Tensor]]:
    """`text_batch` per micro-batch: the tokenized pairs, ready to score (a server tokenizes before it takes the
    model's lock)."""
    return [text_batch(tokenizer, prompts[start:start + micro_batch_size], responses[start:start + micro_batch_size],
                       chat_template, max_length) for start in range(0, len(prompts), micro_batch_size)]


@torch.no_grad()
def score_batches(model, batches: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Scores [B] of tokenized (prompt, response) micro-batches (`text_batches`)."""
    device = next(model.parameters()).device
    out = [reward_model_scores(model, tokens.to(device), lengths.to(device)).cpu() for tokens, lengths in batches]
    return torch.cat(out) if out else torch.zeros(0)


@torch.no_grad()
def text_reward_scores(model, tokenizer, prompts: list[str], responses: list[str], chat_template: bool = False,
                       micro_batch_size: int = 64) -> Tensor:
    """Scores [B] of (prompt, response) texts by a reward model with its own tokenizer."""
    return score_batches(model, text_batches(tokenizer, prompts, responses, chat_template, reward_limit(model),
                                             micro_batch_size))


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (same vocabulary and special tokens)."""
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
