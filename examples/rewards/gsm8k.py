"""Reward functions for GSM8K-style data (a `question` to prompt with, an `answer` whose final line is '#### <number>'),
as `reward.function` / `reward.functions` name them: 'examples/rewards/gsm8k.py:exact_match'.

A reward function is called as fn(prompts, responses, **columns) -> list[float]: one score per response, and for each
column of the data set it names (here `answer`) that column's value of each sample. This file is loaded by its path in
every process that scores (no package, no sys.path entry needed); on a cluster it must be at that path in every pod
that scores (in the image, or in the code the deployment pulls).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in `text` (after '####' when there is one), without thousands separators or a trailing '.0'."""
    text = text.split("####")[-1] if "####" in text else text
    numbers = NUMBER.findall(text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def exact_match(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 when the response's final number is the reference answer's, else 0.0 (GSM8K's accuracy)."""
    return [1.0 if (got := final_number(response)) is not None and got == final_number(reference) else 0.0
            for response, reference in zip(responses, answer)]


def answer_format(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response ends with its answer (a number in its last line), else 0.0: a small shaping reward."""
    return [1.0 if response.strip() and NUMBER.search(response.strip().splitlines()[-1]) else 0.0
            for response in responses]
