"""The data of the stages before RL, read from the same sources as `data.prompts` (models/data.read_rows: files,
folders, save_to_disk directories, hub ids, builtin:<task>) and tokenized as the RL stage will see the sequences.

SFT rows, as TRL's SFTTrainer takes them: `prompt` and `completion` (strings, or chat messages: the prompt's turns and
the completion's assistant turn), or `messages` (a conversation whose last turn, the assistant's, is the completion).
Preference rows, as TRL's RewardTrainer takes them: `prompt`, `chosen`, `rejected` (strings or chat messages), and an
optional `margin` (a number per pair). Other columns are ignored.

The sequence layout is the RL stage's: a plain prompt is encoded as `data.prompts` are (models/data.encode, the
tokenizer's special tokens included), then the completion's own tokens, then EOS; the two are never merged across the
boundary (TRL encodes prompt + completion as one string), so what SFT trains on and what the reward model scores is
what the policy sees and writes in the RL stage. Chat messages are rendered with the tokenizer's chat template (the
prompt with the generation prompt, then the whole conversation); the completion starts where the two renderings
diverge (TRL's rule), counted when that is before the prompt's end.

A sequence longer than `max_length` (None = the model's position limit): an SFT row keeps its first max_length
tokens (TRL's keep_start) unless its prompt alone fills them, then it is dropped; a pair is dropped (TRL filters
them). Both are counted. Everything here runs before any model loads (the tokenizer only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.chat import ChatTemplateError
from models.data import DataError, read_rows, render_messages
from models.environments.chat import ChatFormat, ChatFormatError
from models.resolve import Resolved


@dataclass
class Sequences:
    """Tokenized SFT rows: each a prompt followed by its completion (EOS included)."""

    ids: list[list[int]]
    prompt_lengths: list[int]
    source: str
    dropped: int = 0  # rows whose prompt alone fills max_length
    truncated: int = 0  # rows cut to max_length
    mismatched: int = 0  # chat rows whose rendered prompt is not a prefix of the rendered conversation
    # per row, the tokens trained on (1) when they are not simply those after the prompt (a tool-calling
    # conversation: its assistant turns, not the tool replies between them); None for a row without
    masks: list[list[int] | None] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: int) -> "Sequences":
        """The first `n` rows."""
        return Sequences(self.ids[:n], self.prompt_lengths[:n], self.source, self.dropped, self.truncated,
                         self.mismatched, self.masks[:n] if self.masks is not None else None)

    def rows(self, indices: list[int]) -> dict:
        """The rows `indices` as a command carries them to every rank (plain lists)."""
        out = {"ids": [self.ids[i] for i in indices], "prompt_lengths": [self.prompt_lengths[i] for i in indices]}
        if self.masks is not None:
            out["masks"] = [self.masks[i] for i in indices]
        return out


@dataclass
class Pairs:
    """Tokenized preference pairs: prompt + chosen and prompt + rejected (EOS included), an optional margin each."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: list[float] | None
    source: str
    texts: list[tuple[str, str, str]]  # (prompt, chosen, rejected) as given, for sample tables
    dropped: int = 0  # pairs longer than max_length
    mismatched: int = 0
    prompt_lengths: list[tuple[int, int]] = field(default_factory=list)  # the prompt's tokens in (chosen, rejected)

    def __len__(self) -> int:
        return len(self.chosen)

    def head(self, n: int) -> "Pairs":
        """The first `n` pairs."""
        return Pairs(self.chosen[:n], self.rejected[:n], self.margin[:n] if self.margin is not None else None,
                     self.source, self.texts[:n], self.dropped, self.mismatched, self.prompt_lengths[:n])

    def rows(self, indices: list[int]) -> dict:
        out = {"chosen": [self.chosen[i] for i in indices], "rejected": [self.rejected[i] for i in indices],
               "prompt_lengths": [self.prompt_lengths[i] for i in indices]}
        if self.margin is not None:
            out["margin"] = [self.margin[i] for i in indices]
        return out


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded tokens [B, L] and lengths [B] of token lists."""
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tokens, lengths


# ---------------------------------------------------------------- one sequence

def is_chat(value) -> bool:
    return isinstance(value, list)


def sequence_ids(tokenizer, prompt, completion, where: str) -> tuple[list[int], int, bool]:
    """Token ids of prompt + completion, the prompt's length in them, and whether a chat rendering diverged before the
    prompt's end (see the module docstring)."""
    if is_chat(prompt) != is_chat(completion):
        raise DataError(f"{where}: the prompt and the completion must both be strings or both chat messages")
    if not is_chat(prompt):
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion.strip():
            raise DataError(f"{where}: expected a string prompt and a non-empty string completion, got "
                            f"{prompt!r:.80} and {completion!r:.80}")
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if not completion_ids or completion_ids[-1] != tokenizer.eos_token_id:
            completion_ids = completion_ids + [tokenizer.eos_token_id]
        return prompt_ids + completion_ids, len(prompt_ids), False
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: holds chat messages, but the tokenizer has no chat template")
    if not completion or any(not isinstance(m, dict) or m.get("role") != "assistant" for m in completion):
        raise DataError(f"{where}: the completion must be assistant turns, got {completion!r:.200}")
    rendered_prompt = render_messages(tokenizer, prompt, where)
    whole = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
    prompt_ids = tokenizer(rendered_prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    shared = 0
    while shared < min(len(prompt_ids), len(ids)) and prompt_ids[shared] == ids[shared]:
        shared += 1
    if shared >= len(ids):
        raise DataError(f"{where}: the conversation renders to no token after its prompt")
    return ids, shared, shared < len(prompt_ids)


def position_limit(tokenizer, max_length: int | None, model_config=None) -> int | None:
    """max_length, else the model's position limit (max_position_embeddings / n_positions), else None."""
    if max_length is not None:
        return max_length
    config = model_config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(limit) if limit else None


# ---------------------------------------------------------------- SFT rows

def load_sequences(source: Resolved, split: str, tokenizer, max_length: int | None = None) -> Sequences:
    """SFT rows of a pinned `source` (split `split`: models/data.read_rows) tokenized; a DataError naming the source
    and the problem otherwise."""
    rows = _rows(source, split)
    field, source = source.field, source.value
    names = rows.column_names
    if "messages" in names and "prompt" not in names:
        form = "messages"
    elif "prompt" in names and "completion" in names:
        form = "prompt-completion"
    else:
        raise DataError(f"{field}: '{source}' needs the columns 'prompt' and 'completion', or 'messages' (TRL's SFT "
                        f"forms); its columns: {names}")
    out = Sequences([], [], source)
    for i, row in enumerate(rows):
        where = f"{field}: row {i} of '{source}' (split '{split}')"
        mask = None
        if form == "messages":
            messages = row["messages"]
            if not is_chat(messages) or len(messages) < 2 or not isinstance(messages[-1], dict) \
                    or messages[-1].get("role") != "assistant":
                raise DataError(f"{where}: 'messages' must be a conversation ending with an assistant turn")
            if is_tool_conversation(row):
                ids, mask = tool_conversation_ids(tokenizer, row, where)
                prompt_length, mismatched = mask.index(1), False
            else:
                ids, prompt_length, mismatched = sequence_ids(tokenizer, messages[:-1], messages[-1:], where)
        else:
            ids, prompt_length, mismatched = sequence_ids(tokenizer, row["prompt"], row["completion"], where)
        out.mismatched += mismatched
        if max_length is not None and len(ids) > max_length:
            if prompt_length >= max_length:
                out.dropped += 1
                continue
            ids, out.truncated = ids[:max_length], out.truncated + 1
            mask = mask[:max_length] if mask is not None else None
        out.ids.append(ids)
        out.prompt_lengths.append(prompt_length)
        if mask is not None:
            out.masks = (out.masks or [None] * (len(out.ids) - 1)) + [mask]
        elif out.masks is not None:
            out.masks.append(None)
    if not out.ids:
        raise DataError(f"{field}: no row of '{source}' (split '{split}') fits max_length={max_length} tokens with "
                        f"a completion token to learn")
    return out


def is_tool_conversation(row: dict) -> bool:
    """A `messages` row that calls tools: it has a `tools` column, or a tool message or an assistant tool call."""
    return bool(row.get("tools")) or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                         for m in row["messages"])


def tool_conversation_ids(tokenizer, row: dict, where: str) -> tuple[list[int], list[int]]:
    """A tool-calling conversation as an environment run's episodes hold it (models/environments/chat.py: the prompt
    with the tools' schemas, each assistant turn up to its end-of-turn token, the tool replies between), and its
    mask: 1 on every assistant turn (TRL's assistant-only loss), 0 on the rest."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: holds chat messages, but the tokenizer has no chat template")
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]  # Arrow fills absent keys
    try:
        ids, mask = ChatFormat(tokenizer).conversation(messages, tools or None)
    except (ChatFormatError, ChatTemplateError) as exc:
        raise DataError(f"{where}: {exc}") from None
    if 1 not in mask:
        raise DataError(f"{where}: the conversation has no assistant turn to learn")
    return ids, mask


# ---------------------------------------------------------------- preference pairs

def load_pairs(source: Resolved, split: str, tokenizer, max_length: int | None = None) -> Pairs:
    """Preference pairs of a pinned `source` (split `split`, as `load_sequences`) tokenized; a DataError naming the
    source and the problem otherwise."""
    rows = _rows(source, split)
    field, source = source.field, source.value
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in rows.column_names]
    if missing:
        raise DataError(f"{field}: '{source}' lacks the column(s) {missing} (TRL's preference form: prompt, chosen, "
                        f"rejected, and an optional margin); its columns: {rows.column_names}")
    has_margin = "margin" in rows.column_names
    out = Pairs([], [], [] if has_margin else None, source, [])
    for i, row in enumerate(rows):
        where = f"{field}: row {i} of '{source}' (split '{split}')"
        chosen, c_len, c_bad = sequence_ids(tokenizer, row["prompt"], row["chosen"], f"{where}, chosen")
        rejected, r_len, r_bad = sequence_ids(tokenizer, row["prompt"], row["rejected"], f"{where}, rejected")
        out.mismatched += c_bad or r_bad
        if max_length is not None and max(len(chosen), len(rejected)) > max_length:
            out.dropped += 1
            continue
        if has_margin:
            margin = row["margin"]
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
                raise DataError(f"{where}: 'margin' must be a number, got {margin!r}")
            out.margin.append(float(margin))
        out.chosen.append(chosen)
        out.rejected.append(rejected)
        out.prompt_lengths.append((c_len, r_len))
        out.texts.append(tuple(_text(row[k]) for k in ("prompt", "chosen", "rejected")))
    if not out.chosen:
        raise DataError(f"{field}: no pair of '{source}' (split '{split}') fits max_length={max_length} tokens")
    return out


def _text(value) -> str:
    return value if isinstance(value, str) else " | ".join(f"{m.get('role')}: {m.get('content')}" for m in value)


def _rows(source: Resolved, split: str):
    rows = read_rows(source, split)
    if len(rows) == 0:
        raise DataError(f"{source.field}: split '{split}' of '{source.value}' is empty")
    return rows


# ---------------------------------------------------------------- what a stage was made from

def rows_digest(source: Resolved, split: str) -> str:
    """sha256 of the rows of a pinned `source` (split `split`) as read: every row as canonical JSON, in order. The
    same rows give the same digest whatever the file format they came in; any changed value, row or order changes
    it."""
    digest = hashlib.sha256()
    for row in _rows(source, split):
        digest.update(json.dumps(row, sort_keys=True, default=str, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()
