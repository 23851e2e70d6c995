"""Chat templates and tool calls, the same on the rollout server and in the trainer: a conversation rendered into
token ids with the tokenizer's own chat template, and a completion's tool calls parsed with the tokenizer's own
response template (transformers' `parse_response`).

Imports nothing (the standard library only; it is handed tokenizers), so that the rollout server (in .venv-vllm,
transformers 5.19: components/serving/rollout/openai.py, which may import this module of the project and no other)
and the trainer (in .venv, transformers 5.23: models/environments/chat.py) run the same code.

    response_template(tokenizer, model_type)   the tokenizer's response template, or transformers' own for the
                                               model family (None: the family has none, tools are refused)
    normalize_messages(messages)               OpenAI-format messages as vLLM hands them to a chat template
    render(tokenizer, messages, tools, ...)    -> prompt token ids
    read_response(tokenizer, template, completion_ids, prompt_ids, tools) -> the assistant message (ValueError if
                                               its tool-call markup does not parse)
    parse_completion(tokenizer, template, completion_ids, prompt_ids, tools) -> ParsedCompletion (OpenAI's shape:
                                               the server's); models/environments/chat.py reads TRL's shape from
                                               read_response

Tool calls, as the peers' known failures ask (TRL #4708, #4890): every call of a parallel call is kept; a completion
whose tool-call markup does not parse (cut off by max_tokens, bad JSON, a call without a name) is returned as plain
content with `error` saying why, never an exception; a family without a response template cannot take tools at all
(`ToolsUnsupported`), never a silent plain-text answer.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


class ToolsUnsupported(ValueError):
    """The tokenizer has no response template: tool calls in its completions cannot be parsed."""


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the tokenizer's chat template (the message says why)."""


def response_template(tokenizer, model_type: Optional[str] = None) -> Optional[dict]:
    """The response template that parses this tokenizer's completions: its own (`tokenizer.response_template`, saved
    in tokenizer_config.json), else the one transformers ships for the model family (`transformers serve`'s table,
    by config.model_type: Qwen2/2.5/3, Gemma 4, ...), else None."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None or model_type is None:
        return own
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS  # optional: `serve`'s table
    except ImportError:  # a transformers without the table: only the tokenizer's own
        return None
    return next((t for types, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if model_type in types), None)


def _text(content: Any) -> Any:
    """A message's content as a chat template takes it: a list of parts becomes their text joined by newlines (vLLM's
    "string" content format); anything else is kept."""
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content
                 if not isinstance(p, dict) or p.get("type", "text") == "text"]
        return "\n".join(parts)
    return content


def _arguments(arguments: Any) -> dict:
    """A tool call's arguments as templates expect them (a mapping): a JSON string is parsed; what is not a JSON
    object becomes {} (as vLLM does: a malformed call in the history must not fail every later turn)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-format messages as vLLM hands them to a chat template: content parts joined into text, an assistant's
    `tool_calls` arguments as mappings (an empty `tool_calls` dropped), a missing content as ""; other keys kept."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: a message is an object with a string `role`")
        m = {k: v for k, v in message.items() if v is not None or k == "content"}
        m["content"] = _text(message.get("content")) if message.get("content") is not None else ""
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls is not None:
            if not calls:
                m.pop("tool_calls")
            else:
                fixed = []
                for j, call in enumerate(calls):
                    function = call.get("function") if isinstance(call, dict) else None
                    if not isinstance(function, dict):
                        raise ChatTemplateError(f"messages[{i}].tool_calls[{j}]: a tool call is an object with a "
                                                f"`function` object")
                    fixed.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
                m["tool_calls"] = fixed
        out.append(m)
    return out


def render(tokenizer, messages: Sequence[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False, chat_template: Optional[str] = None,
           template_kwargs: Optional[dict] = None) -> list[int]:
    """The token ids of `messages` (OpenAI format) rendered with the tokenizer's chat template (or `chat_template`),
    `tools` given to the template, the special tokens the template writes and no others (as vLLM renders a chat)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("messages: the model's tokenizer has no chat template; send token ids instead")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt, continue_final_message: at most one of them may be true")
    try:
        ids = tokenizer.apply_chat_template(normalize_messages(messages), tools=tools or None,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            chat_template=chat_template, tokenize=True, return_dict=False,
                                            **(template_kwargs or {}))
    except ChatTemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's errors (a template's raise_exception, undefined fields, ...)
        raise ChatTemplateError(f"messages: the chat template cannot render this conversation "
                                f"({type(exc).__name__}: {exc})") from None
    if isinstance(ids, dict):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@dataclass
class ParsedCompletion:
    """A completion as an assistant message: its text content (None when it is only tool calls), its tool calls in
    the OpenAI shape (`{id, type: function, function: {name, arguments: JSON string}}`, every call of a parallel
    call), and why its tool-call markup did not parse (`error`; then `content` is the whole text and there are no
    calls)."""

    content: Optional[str]
    tool_calls: list[dict] = field(default_factory=list)
    error: Optional[str] = None
    reasoning: Optional[str] = None


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"  # the shape of vLLM's ids


def read_response(tokenizer, template: Optional[dict], completion_ids: Sequence[int], prompt_ids: Sequence[int],
                  tools: Optional[list[dict]] = None) -> dict:
    """A completion read as an assistant message with the tokenizer's response `template` (`response_template`), the
    prompt as its prefix (templates that pre-write part of the answer, e.g. an opening <think>): `content`, and
    `tool_calls` as the template gives them (`{type, function: {name, arguments: a mapping}}`, every call of a
    parallel call; a call without arguments gets {}). ValueError saying why when the markup does not parse or a call
    has no name or its arguments are not an object; ToolsUnsupported when there is no template."""
    if template is None:
        raise ToolsUnsupported("tools: this model's tokenizer has no response template, so tool calls in its "
                               "completions cannot be parsed (transformers' parse_response); send no tools, or use "
                               "a tokenizer whose tokenizer_config.json has a `response_template`")
    try:
        parsed = tokenizer.parse_response(list(completion_ids), template, prefix=list(prompt_ids), tools=tools or None)
    except Exception as exc:  # noqa: BLE001 - the model wrote markup the template cannot read
        raise ValueError(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"the response template read no message: {parsed!r}"[:300])
    calls = parsed.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"tool_calls is not a list: {calls!r}"[:300])
    for i, call in enumerate(calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(function, dict) and function.get("arguments") is None:
            function["arguments"] = {}
        if not isinstance(name, str) or not name or not isinstance(function.get("arguments"), dict):
            raise ValueError(f"tool call {i} has no name or its arguments are not an object: {call!r}"[:300])
    return parsed


def parse_completion(tokenizer, template: Optional[dict], completion_ids: Sequence[int], prompt_ids: Sequence[int],
                     tools: Optional[list[dict]] = None, text: Optional[str] = None) -> ParsedCompletion:
    """Parse a completion's tool calls (`read_response`) into OpenAI's shape. `text`: the completion as the client
    sees it when there are no calls (vLLM's detokenized text, special tokens skipped); default: decoded here.
    Never raises for what the model wrote: a call that does not parse leaves the whole text as content, with `error`."""
    plain = text if text is not None else tokenizer.decode(list(completion_ids), skip_special_tokens=True)
    try:
        parsed = read_response(tokenizer, template, completion_ids, prompt_ids, tools)
    except ToolsUnsupported:
        raise
    except ValueError as exc:
        return ParsedCompletion(plain, [], str(exc))
    calls = [{"id": tool_call_id(), "type": "function",
              "function": {"name": call["function"]["name"],
                           "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}}
             for call in parsed.get("tool_calls") or []]
    if not calls:
        return ParsedCompletion(plain, [], None, None)
    content = parsed.get("content")
    reasoning = parsed.get("reasoning_content", parsed.get("thinking"))
    return ParsedCompletion(content if isinstance(content, str) and content.strip() else None, calls, None,
                            reasoning if isinstance(reasoning, str) and reasoning else None)
