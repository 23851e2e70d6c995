"""An episode's chat format in token ids, by TRL 1.16's rules (GRPOTrainer's tool loop), so nothing is re-tokenised:

- the prompt: the row's messages rendered with the tools' JSON schemas and the generation prompt;
- a model turn: the sampled ids as they are (its stop token included), read as a message by the tokenizer's
  response template (transformers' `parse_response`, the prompt so far as its prefix: models/chat.py's
  `read_response`, the rollout server's parser too); a reply that does not parse (a malformed tool call) is plain
  text, which ends the episode;
- an environment reply: the ids of the tool messages as the template renders them after an assistant turn
  (`suffix_ids`: a dummy conversation rendered with and without them, the first cut after its last end-of-turn
  token), appended to prompt + completion so far.

That is only sound for a prefix-preserving template (rendering more messages never changes how the earlier ones
render), which `ChatFormat.check` verifies before a run starts, together with the template rendering a tool-calling
conversation at all and the tokenizer having a response template (else transformers' fallback for the model's
family, as `transformers serve` uses); each refusal names the field to change.
"""

from __future__ import annotations

from pathlib import Path

from models.chat import read_response, render as render_ids, response_template as response_template_of

SENTINELS = {"name": "tool_name_a8f3e2b1", "key": "tool_arg_key_b9d4f5c2", "value": "tool_arg_val_d6e7a9f3",
             "content": "tool_content_c4f9a8e2"}


class ChatFormatError(ValueError):
    """A chat template or tokenizer that cannot carry tool-calling episodes; the message names the field."""


def read_template(value: str | None, field: str = "environment.chat_template") -> str | None:
    """The text of a chat template given as a .jinja file (or as template text itself); None stays None."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if value.endswith((".jinja", ".j2", ".txt")) or path.is_file():
        if not path.is_file():
            raise ChatFormatError(f"{field}: chat template file '{path}' does not exist")
        return path.read_text()
    if "{%" not in value and "{{" not in value:
        raise ChatFormatError(f"{field}: {value!r} is neither a template file nor template text")
    return value


class ChatFormat:
    """The policy tokenizer's chat format for episodes (its own template, or `chat_template` instead)."""

    def __init__(self, tokenizer, chat_template: str | None = None, model_type: str | None = None,
                 response_template: dict | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template
        self.response_template = response_template or response_template_of(tokenizer, model_type)
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
        return render_ids(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                          chat_template=self.template)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt of an episode: its messages with the tools' schemas and the generation prompt."""
        return self.render(messages, tools, add_generation_prompt=True)

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token when these tool messages answer it, up to and
        including the next generation prompt (TRL's `_get_tool_suffix_ids`)."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = self.render(dummy)
        full = self.render(dummy + list(tool_messages), add_generation_prompt=True)
        ends = [i for i, token in enumerate(prefix) if token == self.eos_id]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ChatFormatError("the chat template rendered an assistant turn differently once tool messages "
                                  "followed it (it is not prefix-preserving)")
        return full[len(prefix):]

    def parse(self, ids: list[int], prefix: list[int], tools: list[dict] | None) -> dict:
        """A model turn as a message: content and tool calls, read with the response template; a turn that does not
        parse (a malformed tool call) is its decoded text (TRL's `parse_response`)."""
        tokenizer = self.tokenizer
        try:
            parsed = read_response(tokenizer, self.response_template, ids, prefix, tools)
        except ValueError:
            return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        return parsed

    def conversation(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """A whole conversation in token ids as an episode would hold it, and its mask: 1 on each assistant turn's
        tokens up to and including its end-of-turn token (what the model samples), 0 on the rest (the prompt, the
        tool and user messages between turns, and the generation prompts): what an SFT stage trains on."""
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], tools, add_generation_prompt=True)
            after = self.render(messages[:i + 1], tools)
            if before[:len(ids)] != ids or after[:len(before)] != before:
                raise ChatFormatError(f"message {i}: the chat template renders the conversation before it "
                                      f"differently once it follows (the template is not prefix-preserving)")
            turn = after[len(before):]
            ends = [j for j, token in enumerate(turn) if token == self.eos_id]
            turn = turn[:ends[-1] + 1] if ends else turn
            mask += [0] * (len(before) - len(ids)) + [1] * len(turn)
            ids = before + turn
        return ids, mask

    def check(self, template_field: str) -> None:
        """Refuse, naming the field, a format that cannot carry tool-calling episodes (see the module docstring)."""
        if not (self.template or getattr(self.tokenizer, "chat_template", None)):
            raise ChatFormatError(f"{template_field}: the policy's tokenizer has no chat template; an environment "
                                  f"run renders its episodes with one (set environment.chat_template)")
        call = [{"type": "function", "function": {"name": SENTINELS["name"],
                                                  "arguments": {SENTINELS["key"]: SENTINELS["value"]}}}]
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": call},
                        {"role": "tool", "name": SENTINELS["name"], "content": SENTINELS["content"]}]
        try:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=self.template, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - jinja raises several kinds for a role it does not know
            raise ChatFormatError(f"{template_field}: the chat template cannot render a tool-calling conversation "
                                  f"(user, assistant with tool_calls, tool): {type(exc).__name__}: {exc}") from None
        dropped = [part for part, sentinel in SENTINELS.items() if sentinel not in text]
        if dropped:
            raise ChatFormatError(f"{template_field}: the chat template drops the tool call's {', '.join(dropped)} "
                                  f"when it renders a tool-calling conversation: it does not support tools")
        dummy = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
        turn = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": dummy}]
        before = self.render(turn)
        after = self.render(turn + [{"role": "tool", "name": "dummy", "content": "dummy"}], add_generation_prompt=True)
        if after[:len(before)] != before:
            raise ChatFormatError(f"{template_field}: the chat template is not prefix-preserving (an assistant turn "
                                  f"renders differently once a tool message follows it), so an episode's tokens "
                                  f"could not be extended turn by turn; give a training template that is (TRL ships "
                                  f"them: trl/chat_templates/*_training.jinja, e.g. qwen3_training.jinja) as "
                                  f"environment.chat_template")
        if self.response_template is None:
            raise ChatFormatError(f"{template_field}: the policy's tokenizer has no response template "
                                  f"(tokenizer_config.json `response_template`) to read tool calls with, and "
                                  f"transformers has none for its model type: tool calls cannot be parsed; save the "
                                  f"tokenizer with a response_template (transformers' chat response parsing docs)")

