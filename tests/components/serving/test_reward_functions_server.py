"""A reward server scoring with the user's reward file (a folder that is no package, named relative to where the run
starts): it loads the file by path in its own process, scores the weighted sum of the functions, answers each
function's scores (`function_rewards`) beside `rewards`, over tokens and text alike, as the in-process backend does."""

from __future__ import annotations

import pytest
import torch

from components.launch.processes import find_free_ports
from components.serving.launcher import launch
from components.serving.triton.clients import RewardClient
from components.serving.triton.contract import ServerSpec
from models.backends import FunctionReward
from models.config import preset
from models.prepare import prepare_run
from models.reward import load_reward_functions

REWARDS = '''
def mentions(prompts, responses, target):
    return [1.0 if t in r.split() else 0.0 for t, r in zip(target, responses)]

def brevity(prompts, responses):
    return [-len(r.split()) / 10 for r in responses]
'''

PROMPTS = ["review the cat :", "describe the dog :", "tell me about the movie :"]
RESPONSES = ["the cat is good .", "it was bad", "i love the movie and the song ."]
COLUMNS = [{"target": "cat"}, {"target": "dog"}, {"target": "movie"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-functions")
    (root / "user").mkdir()
    (root / "user" / "my_rewards.py").write_text(REWARDS)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root / "user")  # the run starts here: the spec names the file relative to it
        cfg = prepare_run(preset("tiny", **{
            "algorithm": "rloo", "deploy.state_dir": str(root / "state"), "model.policy": tiny_models["policy"],
            "reward.source": "function", "reward.functions": ["my_rewards.py:mentions", "my_rewards.py:brevity"],
            "reward.weights": [1.0, 0.5]}))
    assert cfg.reward.functions == [f"{root / 'user' / 'my_rewards.py'}:{n}" for n in ("mentions", "brevity")]
    proc = launch(ServerSpec(kind="reward", config=cfg, port=find_free_ports()), root / "reward.log", wait=False)
    try:
        proc.wait_until_ready(120)
        yield {"cfg": cfg, "proc": proc}
    finally:
        proc.stop()


def test_the_reward_server_answers_the_weighted_sum_and_each_functions_scores(server):
    from models.policy import load_policy_tokenizer

    cfg = server["cfg"]
    expected = FunctionReward(load_reward_functions(cfg.reward)).score_async(
        None, None, None, PROMPTS, RESPONSES, COLUMNS).result()
    mentions, brevity = [1.0, 0.0, 1.0], [-len(r.split()) / 10 for r in RESPONSES]
    torch.testing.assert_close(expected["function_rewards"], torch.tensor([mentions, brevity]).T)
    torch.testing.assert_close(expected["scores"], torch.tensor([m + 0.5 * b for m, b in zip(mentions, brevity)]))

    tokenizer = load_policy_tokenizer(cfg.resolve_model_path(cfg.model.policy))
    rows = [tokenizer(p)["input_ids"] + tokenizer(r)["input_ids"] for p, r in zip(PROMPTS, RESPONSES)]
    tokens = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    prompt_lengths = torch.tensor([len(tokenizer(p)["input_ids"]) for p in PROMPTS])
    for text in (False, True):
        with RewardClient(server["proc"].url, text=text) as client:
            answer = client.score_async(tokens, lengths, prompt_lengths, PROMPTS, RESPONSES, COLUMNS).result(timeout=60)
        assert answer.keys() == {"scores", "function_rewards"}, text
        torch.testing.assert_close(answer["scores"], expected["scores"])
        torch.testing.assert_close(answer["function_rewards"], expected["function_rewards"])
    assert server["proc"].poll() is None
