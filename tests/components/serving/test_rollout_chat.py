"""The chat template and tool-call logic the rollout server and the trainer share (models/chat.py), and the verifiers
worker's merge of a rollout's steps (components/verifiers/worker.py): pure functions on the test's tiny Qwen2.5-format
tokenizer (tests/components/serving/tool_model.py)."""

import json

import pytest

from models.chat import (ChatTemplateError, ToolsUnsupported, normalize_messages, parse_completion, render,
                         response_template)
from components.verifiers.worker import merge_steps
from tests.components.serving.tool_model import QWEN2_RESPONSE_TEMPLATE, build_tokenizer

pytestmark = pytest.mark.fast  # no server, stack or second process

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_conversation_renders_with_the_models_template_and_tools(tok):
    prompt = render(tok, [{"role": "user", "content": "2 + 3?"}], TOOLS)
    text = tok.decode(prompt)
    assert text.startswith("<|im_start|>system\n") and '"name": "add"' in text
    assert text.endswith("<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # an assistant turn's tool call arguments arrive as a JSON string (OpenAI format): rendered as the object
    history = [{"role": "user", "content": "2 + 3?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    text = tok.decode(render(tok, history, TOOLS))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert normalize_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
                              )[0]["tool_calls"][0]["function"]["arguments"] == {}  # not an object: {} as vLLM
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "a\nb"
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]: a message is an object"):
        render(tok, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="add_generation_prompt, continue_final_message"):
        render(tok, [{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)


def test_tool_calls_parsed_with_the_response_template_parallel_calls_kept(tok):
    prompt = render(tok, [{"role": "user", "content": "sums"}], TOOLS)
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 1}}\n</tool_call><|im_end|>')
    parsed = parse_completion(tok, response_template(tok), ids(tok, two), prompt, TOOLS)
    assert parsed.error is None and parsed.content is None
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"a": 2, "b": 3}, {"a": 1, "b": 1}]
    assert all(c["type"] == "function" and c["function"]["name"] == "add" and c["id"].startswith("chatcmpl-tool-")
               for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    text = parse_completion(tok, response_template(tok), ids(tok, "just words<|im_end|>"), prompt, TOOLS)
    assert (text.content, text.tool_calls, text.error) == ("just words", [], None)


@pytest.mark.parametrize("completion", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2',  # cut off by max_tokens
    '<tool_call>\n{"name": "add", "arguments": {"a": 2,, }}\n</tool_call><|im_end|>',  # bad JSON
    '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call><|im_end|>',  # no name
    '<tool_call>\n["add"]\n</tool_call><|im_end|>',  # not an object
])
def test_a_malformed_call_is_content_with_the_reason_never_an_exception(tok, completion):
    prompt = render(tok, [{"role": "user", "content": "x"}], TOOLS)
    parsed = parse_completion(tok, response_template(tok), ids(tok, completion), prompt, TOOLS)
    assert parsed.tool_calls == [] and parsed.error
    assert parsed.content == tok.decode(ids(tok, completion), skip_special_tokens=True)


def test_a_family_without_a_response_template_refuses_tools(tok):
    assert response_template(tok) == QWEN2_RESPONSE_TEMPLATE
    tok.response_template = None
    try:
        assert response_template(tok) is None
        assert response_template(tok, "qwen2") is not None  # transformers' own table for a known family
        with pytest.raises(ToolsUnsupported, match="tools: this model's tokenizer has no response template"):
            parse_completion(tok, response_template(tok, "gpt2"), [1], [2], TOOLS)
    finally:
        tok.response_template = QWEN2_RESPONSE_TEMPLATE


def step(prompt, completion, logprob=-0.5):
    return {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": [1] * len(completion),
            "completion_logprobs": [logprob] * len(completion)}


def test_steps_merge_while_each_prompt_extends_the_last_prompt_and_completion():
    steps = [step([1, 2], [3, 4]), step([1, 2, 3, 4, 9, 9], [5]), step([7, 7], [8])]  # the third does not extend
    samples = merge_steps(steps)
    assert samples == [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 9, 9, 5], "completion_mask": [1, 1, 0, 0, 1],
                        "completion_logprobs": [-0.5, -0.5, 0.0, 0.0, -0.5]},
                       {"prompt_ids": [7, 7], "completion_ids": [8], "completion_mask": [1],
                        "completion_logprobs": [-0.5]}]
    assert all(sum(s["completion_mask"]) == 0 for s in merge_steps(steps, errored=True))  # nothing of it trains
