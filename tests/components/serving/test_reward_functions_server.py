"""A reward server scoring with the user's reward file (a folder that is no package, named relative to where the run
starts), which reaches it through the run's store: the run stores the file's bytes in its store on S3 (moto) where it
starts, the file is then gone from that machine, and the server, started in another working directory, loads the
stored bytes by their digest. It scores the weighted sum of the functions, answers each function's scores
(`function_rewards`) beside `rewards`, over tokens and text alike, as the in-process backend does. A changed file is
another digest, loaded as another module."""

from __future__ import annotations

import hashlib
import shutil
import uuid

import boto3
import pytest
import torch

from components.launch.processes import find_free_ports
from components.serving.launcher import launch
from components.serving.triton.clients import RewardClient
from components.serving.triton.contract import ServerSpec
from components.storage.store import CheckpointStore
from components.tracking.run import store_reward_files
from models.backends import FunctionReward
from models.config import merge, preset
from models.prepare import prepare_run
from models.reward import load_reward_functions
from tests.components.conftest import AWS_ENV

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
def server(tiny_models, tmp_path_factory, moto_endpoint):
    root = tmp_path_factory.mktemp("reward-functions")
    (root / "user").mkdir()
    (root / "user" / "my_rewards.py").write_text(REWARDS)
    (root / "elsewhere").mkdir()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        mp.chdir(root / "user")  # the run starts here: the spec names the file relative to it
        cfg = prepare_run(preset("tiny", **{
            "algorithm": "rloo", "deploy.state_dir": str(root / "state"), "model.policy": tiny_models["policy"],
            "reward.source": "function", "reward.functions": ["my_rewards.py:mentions", "my_rewards.py:brevity"],
            "reward.weights": [1.0, 0.5], "deploy.checkpoint.s3_endpoint_url": moto_endpoint,
            "deploy.cache.dir": str(root / "cache")}))
        assert cfg.reward.functions == [f"{root / 'user' / 'my_rewards.py'}:{n}" for n in ("mentions", "brevity")]
        store = CheckpointStore.from_uri(f"s3://{bucket}/runs/travel", s3_endpoint_url=moto_endpoint)
        cfg, record = store_reward_files(cfg, store)  # what opening the run does (components/tracking/run.py)
        shutil.rmtree(root / "user")  # the file existed only where the run started
        mp.chdir(root / "elsewhere")  # the server's working directory has no such file
        proc = launch(ServerSpec(kind="reward", config=cfg, port=find_free_ports()), root / "reward.log", wait=False)
        try:
            proc.wait_until_ready(120)
            yield {"cfg": cfg, "proc": proc, "record": record, "store": store, "root": root}
        finally:
            proc.stop()


def test_the_reward_file_travels_through_the_runs_store_by_its_digest(server):
    """The run stored the file's bytes under their sha256 in its store and named them in reward.files; the server
    (whose working directory has no such file, and the file is gone) fetched that copy into its cache, checked."""
    digest = hashlib.sha256(REWARDS.encode()).hexdigest()
    path = str(server["root"] / "user" / "my_rewards.py")
    assert server["record"] == {f"reward.functions.{i}": {"path": path, "sha256": digest,
                                                          "uri": f"{server['store'].uri}/rewards/{digest}.py"}
                                for i in range(2)}
    assert server["cfg"].reward.files[path].sha256 == digest
    assert server["store"].s3.get_bytes(f"rewards/{digest}.py") == REWARDS.encode()
    assert (server["root"] / "cache" / "files" / f"{digest}.py").read_text() == REWARDS  # fetched, by its digest


def test_a_changed_reward_file_is_another_digest_and_another_module(server, tmp_path, monkeypatch):
    """Changing a reward is storing other bytes: the next run loads them (no image, no server rebuilt)."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_rewards.py").write_text(REWARDS.replace("-len(r.split()) / 10", "1.0"))
    monkeypatch.chdir(user)
    cfg = merge(server["cfg"], {"reward.functions": [f"{user / 'my_rewards.py'}:brevity"], "reward.weights": None,
                                "reward.files": None})
    cfg, record = store_reward_files(cfg, server["store"])
    assert record["reward.functions.0"]["sha256"] != hashlib.sha256(REWARDS.encode()).hexdigest()
    (user / "my_rewards.py").unlink()
    scores = load_reward_functions(cfg.reward, deploy=cfg.deploy)(PROMPTS, RESPONSES, COLUMNS)
    assert scores == [1.0, 1.0, 1.0]


def test_the_reward_server_answers_the_weighted_sum_and_each_functions_scores(server):
    from models.policy import load_policy_tokenizer

    cfg = server["cfg"]  # the file is gone: the test loads the run's stored copy too
    expected = FunctionReward(load_reward_functions(cfg.reward, deploy=cfg.deploy)).score_async(
        None, None, None, PROMPTS, RESPONSES, COLUMNS).result()
    mentions, brevity = [1.0, 0.0, 1.0], [-len(r.split()) / 10 for r in RESPONSES]
    torch.testing.assert_close(expected["function_rewards"], torch.tensor([mentions, brevity]).T)
    torch.testing.assert_close(expected["scores"], torch.tensor([m + 0.5 * b for m, b in zip(mentions, brevity)]))

    tokenizer = load_policy_tokenizer(cfg.local_path("model.policy"))
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
