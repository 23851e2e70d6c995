"""A tiny chat model with a Qwen2.5-format chat template and tool tokens that calls a tool, for the rollout server's
OpenAI-compatible endpoints and verifiers' clients: built in seconds, no training.

The tokenizer is byte-level (any text encodes, and decodes back exactly) with Qwen2.5's special tokens
(<|im_start|>, <|im_end|>, <|endoftext|>), its tool tokens (<tool_call>, </tool_call>, <tool_response>,
</tool_response>) and a few added tokens for the pieces of one tool call; it carries a Qwen2.5-format chat template
and transformers' Qwen2 response template (so `parse_response` reads its tool calls). The model is a one-layer GPT-2
whose weights are set by hand so that the next token depends on the current token only (attention and MLP add
nothing; one-hot embeddings; the head maps each token to its successor): after the generation prompt
(`<|im_start|>assistant\\n`) it writes `<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>`
and <|im_end|> with probability ~1. Every other token is followed by a uniformly random one. `perturb` turns it into
an ordinary random model (for logprob checks).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, GenerationConfig, PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CALL_PIECES = ['\n{"name": ', '"add", ', '"arguments": ', '{"a": ', '2, ', '"b": ', '3}}\n']
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}

# The Qwen2.5 instruct models' chat-template format: a system turn (the tools' JSON schemas and the tool-call
# instructions when there are tools), <|im_start|>role ... <|im_end|> turns, tool calls as JSON in <tool_call> tags,
# consecutive tool results in one user turn in <tool_response> tags.
QWEN25_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# transformers' response template for Qwen2-format completions (as `transformers serve` uses for the family)
QWEN2_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ")
                                                                                                  + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS + CALL_PIECES])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN25_TEMPLATE
    fast.response_template = QWEN2_RESPONSE_TEMPLATE
    return fast


def build_tool_model(out: str | Path) -> Path:
    """Write the tokenizer and the hand-set model to `out` (a Hugging Face model directory)."""
    out = Path(out)
    tok = build_tokenizer()
    V = len(tok)

    def ids(*pieces):
        return [tok.convert_tokens_to_ids(p) if p in tok.get_vocab() else None for p in pieces]

    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    chain = newline + ids("<tool_call>", *CALL_PIECES, "</tool_call>", "<|im_end|>")
    assert None not in chain and len(set(chain)) == len(chain)
    config = GPT2Config(vocab_size=V, n_positions=2048, n_embd=64 * (V // 64 + 1), n_layer=1,
                        n_head=V // 64 + 1,  # head_dim 64: a size vLLM's CPU attention kernels take
                        tie_word_embeddings=False, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.wte.weight[:, :V] = torch.eye(V)
        model.transformer.ln_f.weight.fill_(1.0)
        block = model.transformer.h[0]
        block.ln_1.weight.fill_(1.0)
        block.ln_2.weight.fill_(1.0)
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following, current] = 2.0  # logit ~33 above every other token after `current`
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def perturb(model, scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
