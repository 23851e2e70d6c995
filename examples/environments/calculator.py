"""A calculator environment in TRL's `environment_factory` protocol (TRL 1.16 GRPOTrainer), run unchanged by
rlhf-flows: `environment.factory: examples/environments/calculator.py:Calculator`.

The protocol, as TRL defines it: the class is built with no arguments, one instance per rollout (instances are
pooled and reused); `reset(**row)` is called with the data set row before each rollout and may return text that is
appended to the row's last user message (here: nothing); every public method other than `reset` and `get_reward` is
a tool, described to the model by transformers' `get_json_schema` (type hints and the Google-style docstring's
`Args:`); a tool's return value is sent back as the tool message's content, an exception as {"error": ...}.

The task (builtin:arithmetic): "What is 347 * 29?". The reward (`correct` below, a reward function in TRL's
convention: completions as messages, the data set's columns as keyword arguments) is 1 when the final answer is the
value. Nothing here imports rlhf-flows.
"""

import ast
import operator

OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
LIMIT = 10**12  # the largest magnitude an operand or result may have


def evaluate(expression: str) -> int:
    """The value of an expression of integers with +, - and * (and parentheses); anything else is refused."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
            result = OPERATIONS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(f"unsupported expression: {expression!r}")
        if abs(result) > LIMIT:
            raise ValueError("number too large")
        return result

    if len(expression) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(expression, mode="eval").body)


class Calculator:
    """One rollout's calculator: counts its calls."""

    def __init__(self):
        self.calls = 0

    def reset(self, **row) -> None:
        self.calls = 0

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12 * 34.
        """
        self.calls += 1
        return str(evaluate(expression))


def final_answer(completion) -> str:
    """The last assistant message's content, stripped."""
    if isinstance(completion, str):
        return completion.strip()
    replies = [m for m in completion if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "").strip() if replies else ""


def correct(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final answer is the expected value, else 0.0."""
    return [1.0 if final_answer(c) == str(a).strip() else 0.0 for c, a in zip(completions, answer)]
