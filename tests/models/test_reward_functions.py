"""Reward functions as a user writes them: a file outside any package ('path/to/rewards.py:fn'), several with weights
(TRL's reward_funcs / reward_weights), each one's scores kept for rewards/<name>/mean and /std, the weighted sum the
score; in process here (the reward server: tests/components/serving/test_reward_functions_server.py)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from models.algorithms.base import collect_rewards
from models.backends import FunctionReward
from models.config import preset
from models.reward import import_function, load_reward_function, load_reward_functions
from models.specs import absolute_spec
from models.step import function_reward_metrics

REWARDS = '''
import re

def exact(prompts, responses, answer):
    """1 when the response's last number is the answer after '####'."""
    out = []
    for response, solution in zip(responses, answer):
        numbers = re.findall(r"-?\\d+", response)
        out.append(1.0 if numbers and numbers[-1] == solution.split("####")[-1].strip() else 0.0)
    return out

def brevity(prompts, responses):
    return [-len(r) / 10 for r in responses]
'''

PROMPTS = ["what is 2 plus 3?", "what is 1 plus 1?", "what is 4 plus 4?"]
RESPONSES = ["2 + 3 = 5", "it is 3", "8"]
COLUMNS = [{"answer": "#### 5"}, {"answer": "#### 2"}, {"answer": "4 + 4 = 8 #### 8"}]


@pytest.fixture
def rewards_file(tmp_path):
    """The user's reward file in a folder that is no package and not on sys.path."""
    path = tmp_path / "user" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(REWARDS)
    return path


def test_a_reward_file_loads_by_path_once_and_a_relative_path_is_made_absolute(rewards_file, monkeypatch):
    assert str(rewards_file.parent) not in sys.path
    exact = load_reward_function(f"{rewards_file}:exact")
    assert exact(PROMPTS, RESPONSES, COLUMNS) == [1.0, 0.0, 1.0]
    assert import_function(f"{rewards_file}:exact") is import_function(f"{rewards_file}:exact")  # loaded once
    monkeypatch.chdir(rewards_file.parent)
    assert absolute_spec("my_rewards.py:brevity") == f"{rewards_file}:brevity"
    assert absolute_spec("models.tasks.sentiment:gold_reward") == "models.tasks.sentiment:gold_reward"


@pytest.mark.parametrize("spec, message", [
    ("{dir}/nope.py:exact", "reward.function: reward file '{dir}/nope.py' does not exist in this process"),
    ("{dir}/my_rewards.py:missing", "reward.function: '{dir}/my_rewards.py' has no function 'missing'"),
    ("no_such_package.rewards:f", "reward.function: cannot import 'no_such_package.rewards:f'"),
])
def test_a_reward_function_that_cannot_load_fails_naming_the_field_and_the_file(rewards_file, spec, message):
    where = str(rewards_file.parent)
    with pytest.raises(ValueError) as failure:
        load_reward_function(spec.format(dir=where))
    assert str(failure.value).startswith(message.format(dir=where)), str(failure.value)


def test_weighted_reward_functions_score_their_weighted_sum_and_keep_each_ones_scores(rewards_file):
    cfg = preset("tiny", **{"reward.source": "function", "reward.weights": [1.0, 0.25],
                            "reward.functions": [f"{rewards_file}:exact", f"{rewards_file}:brevity"]})
    rewards = load_reward_functions(cfg.reward)
    total, each = rewards.score_all(PROMPTS, RESPONSES, COLUMNS)
    exact = [1.0, 0.0, 1.0]
    brevity = [-len(r) / 10 for r in RESPONSES]
    assert each == [exact, brevity]
    assert total == pytest.approx([e + 0.25 * b for e, b in zip(exact, brevity)], abs=1e-12)
    assert rewards(PROMPTS, RESPONSES, COLUMNS) == total
    with pytest.raises(ValueError, match=r"reward.functions\[0\]: .* needs the column\(s\) \['answer'\]"):
        rewards.check_columns(["question"], "data.prompts 'x.parquet'")

    # in process: the backend answers the score and each function's; the step's metrics are TRL's names
    answer = FunctionReward(rewards).score_async(None, None, None, PROMPTS, RESPONSES, COLUMNS).result()
    scored = collect_rewards([FunctionReward(rewards).score_async(None, None, None, PROMPTS[:1], RESPONSES[:1],
                                                                  COLUMNS[:1]),
                              FunctionReward(rewards).score_async(None, None, None, PROMPTS[1:], RESPONSES[1:],
                                                                  COLUMNS[1:])])
    torch.testing.assert_close(scored["scores"], answer["scores"])
    torch.testing.assert_close(scored["function_rewards"], torch.tensor([exact, brevity]).T)
    metrics = function_reward_metrics(scored, cfg.reward.function_names())
    for name, values in (("exact", exact), ("brevity", brevity)):
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
        assert metrics[f"rewards/{name}/mean"] == pytest.approx(mean, abs=1e-6)
        assert metrics[f"rewards/{name}/std"] == pytest.approx(std, abs=1e-6)
    # a reward model's answer (a tensor) has no per-function scores
    assert collect_rewards([FunctionReward(lambda p, r, c: [1.0] * len(r)).score_async(
        None, None, None, PROMPTS, RESPONSES)]).keys() == {"scores"}
