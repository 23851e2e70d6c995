"""reasoning-gym tasks as prompt data (`data.prompts: reasoning_gym:<task>`) with their own scorer.

reasoning-gym (pinned 0.1.25: pure Python, offline) generates a task's items from a seed: {question, answer,
metadata}. A source `reasoning_gym:<task>` reads as rows {prompt: the question, answer, metadata (JSON), task}; its
options (`data.options` / `eval.options`) are `size` (rows; default 1000 for 'train', 200 for any other split),
`seed` (default 0) and the task's own parameters (e.g. chain_sum's min_terms, max_digits), passed to
`reasoning_gym.create_dataset`. Another split than 'train' is drawn from another seed and never holds a question
of the 'train' split with the same options: held-out rows.

`score` is the task's `score_answer` as a reward function (reward.function: models.tasks.reasoning:score): the
answer is the text inside the response's last <answer>...</answer> when it has one, else the whole response,
stripped.
"""

from __future__ import annotations

import json
import re

PREFIX = "reasoning_gym:"
SIZES = {"train": 1000}  # rows of a split when `size` is not given; any other split: HELD_OUT_SIZE
HELD_OUT_SIZE = 200
HELD_OUT_SEED = 1_000_003  # added to the seed for every split but 'train'
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class TaskError(ValueError):
    """A reasoning-gym source or option that cannot be used; the message names the field."""


def items(task: str, options: dict, seed: int, size: int, field: str) -> list[dict]:
    import reasoning_gym  # heavy (~1.5 s, its many tasks): only a reasoning_gym:<task> source needs it

    try:
        return list(reasoning_gym.create_dataset(task, size=size, seed=seed, **options))
    except Exception as exc:  # noqa: BLE001 - an unknown task or parameter: reasoning-gym raises several kinds
        raise TaskError(f"{field}: reasoning_gym:{task} with options {options}: {type(exc).__name__}: {exc}") from None


def rows(task: str, split: str = "train", options: dict | None = None, field: str = "data.prompts") -> list[dict]:
    """The rows of `reasoning_gym:<task>` for `split` (see the module docstring)."""
    options = dict(options or {})
    seed = int(options.pop("seed", 0))
    given = options.pop("size", None)
    size = int(given if given is not None else SIZES.get(split, HELD_OUT_SIZE))
    if size < 1:
        raise TaskError(f"{field}: reasoning_gym:{task} needs size >= 1, got {size}")
    if split == "train":
        chosen = items(task, options, seed, size, field)
    else:
        train_size = int(given if given is not None else SIZES["train"])
        seen = {item["question"] for item in items(task, options, seed, train_size, field)}
        chosen = [item for item in items(task, options, seed + HELD_OUT_SEED, size * 2, field)
                  if item["question"] not in seen][:size]
        if not chosen:
            raise TaskError(f"{field}: reasoning_gym:{task} has no question outside the train split with these "
                            f"options ({options}): its space is too small for a held-out split")
    return [{"prompt": item["question"], "answer": str(item["answer"]), "task": task,
             "metadata": json.dumps(item["metadata"], default=list)} for item in chosen]


def extract(response: str) -> str:
    """The answer in a response: its last <answer>...</answer>, else the whole response; stripped."""
    found = ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def score(prompts: list[str], responses: list[str], answer: list[str], metadata: list[str],
          task: list[str]) -> list[float]:
    """Each response scored by its task's `score_answer` (in [0, 1])."""
    import reasoning_gym  # heavy: see items()

    out = []
    for prompt, response, expected, meta, name in zip(prompts, responses, answer, metadata, task):
        entry = {"question": prompt, "answer": expected, "metadata": json.loads(meta)}
        out.append(float(reasoning_gym.get_score_answer_fn(name)(extract(response), entry)))
    return out
