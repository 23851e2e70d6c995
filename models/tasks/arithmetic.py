"""The shipped tool-use task: arithmetic questions a small model answers by calling a calculator.

A question asks for the value of `a op b` (a and b of two or three digits, + - or *): a tiny model cannot compute
that, so it succeeds by calling the calculator tool with the expression and answering with the tool's result. The
environment (the calculator) is examples/environments/calculator.py, written in TRL's `environment_factory`
protocol; its tool's JSON schema (what transformers' `get_json_schema` makes of its `calculate` method) is
`CALCULATOR_TOOL` here, so the SFT rows render the same system prompt the RL rollouts see (a test keeps the two
equal).

Builtin data (models/data.py): `builtin:arithmetic` (RL rows: `prompt` as chat messages, `answer`),
`builtin:arithmetic_sft` (SFT rows: a whole tool-calling conversation in `messages`, the tool schemas in `tools`, as
TRL's SFTTrainer takes them). The tiny chat model's pretraining conversations (`chat_corpus`: small sums and
repetitions, no tool) are drawn here too. Everything comes from a seed: nothing is downloaded.
"""

from __future__ import annotations

import random

OPERATORS = ("+", "-", "*")
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. 12 * 34."}},
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}
QUESTION = "What is {expression}?"


def expression(rng: random.Random) -> tuple[str, int]:
    """`a op b` and its value: three-digit terms for + and -, a two-digit factor for *."""
    op = rng.choice(OPERATORS)
    a = rng.randint(100, 999)
    b = rng.randint(10, 99) if op == "*" else rng.randint(100, 999)
    return f"{a} {op} {b}", {"+": a + b, "-": a - b, "*": a * b}[op]


def rows(n: int, seed: int = 0) -> list[dict]:
    """`builtin:arithmetic`: RL rows, the prompt as chat messages (one user turn) and the `answer` column."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, value = expression(rng)
        out.append({"prompt": [{"role": "user", "content": QUESTION.format(expression=text)}], "answer": str(value)})
    return out


def conversation(question: str, text: str, value: int) -> list[dict]:
    """A demonstration: the calculator called with the expression, its result given as the answer."""
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": text}}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": str(value)},
            {"role": "assistant", "content": str(value)}]


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """`builtin:arithmetic_sft`: tool-calling conversations (`messages`) with the tool schemas (`tools`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, value = expression(rng)
        out.append({"messages": conversation(QUESTION.format(expression=text), text, value),
                    "tools": [CALCULATOR_TOOL]})
    return out


def chat_corpus(n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations the tiny chat model is pretrained on (no tool): sums of small numbers it can learn, repetitions
    of numbers and expressions (copying, which a tool call and its answer need), and two-turn repetitions whose
    second reply repeats the latest message, not the first."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            op = rng.choice(("+", "-"))
            turns = [(QUESTION.format(expression=f"{a} {op} {b}"), str(a + b if op == "+" else a - b))]
        elif kind == 1:
            text, _ = expression(rng)
            turns = [(f"Repeat: {text}", text)]
        else:
            numbers = [str(rng.randint(-9999, 99999)) for _ in range(1 if kind == 2 else 2)]
            turns = [(f"Say {number}", number) for number in numbers]
        conversation = []
        for question, answer in turns:
            conversation += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(conversation)
    return out
