"""CriticClient / RewardClient against real servers: same PPO metrics as in process, errors, retries, concurrency."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch

from components.launch.processes import find_free_ports
from components.serving.auth import read_secret, request_headers
from components.serving.launcher import launch
from components.serving.triton.clients import (CriticClient, RewardClient, ServerError, ServerUnavailable,
                                               critic_backend, reward_backend, summarize_server_error)
from components.serving.triton.contract import ServerSpec
from models.algorithms import Backends
from models.backends import CriticBackend, LocalCritic, RewardBackend
from models.config import preset
from models.loop import build_actor, build_critic_trainer, gold_function, load_prompts, prompt_batches
from models.prepare import prepare_run
from models.step import train_step
from models.critic import CriticInputError

NON_DETERMINISTIC = ("time/", "throughput/", "step_time")
MAX_BATCH = 16


def assert_implements(obj, protocol) -> bool:
    """obj has every method of `protocol` with the same parameter names (and its attributes)."""
    import inspect

    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        expected = list(inspect.signature(member).parameters)[1:]
        assert list(inspect.signature(getattr(obj, name)).parameters) == expected, name
    for name in getattr(protocol, "__annotations__", {}):
        assert hasattr(obj, name), name
    return True


def ppo_cfg(tiny_models, state_dir, port):
    return prepare_run(preset("tiny", **{
        "deploy.state_dir": str(state_dir), "model.policy": tiny_models["policy"],
        "model.reward": tiny_models["reward"],
        "seed": 3, "ppo.rollout_batch_size": 24, "ppo.minibatch_size": 12, "ppo.epochs": 1,
        "generation.micro_batch_size": 8, "generation.max_new_tokens": 8, "critic.train_batch_size": 12,
        "deploy.critic.port": port, "deploy.critic.max_queue_delay_us": 1000, "deploy.reward.port": port + 10}))


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """The critic server of `cfg` (reward combined) and a reward-model server, side by side on one machine."""
    root = tmp_path_factory.mktemp("clients")
    port = find_free_ports(count=13)
    cfg = ppo_cfg(tiny_models, root, port)
    critic = launch(ServerSpec(kind="critic", config=cfg, port=port, checkpoint_dir=str(root / "critic"),
                               max_batch_size=MAX_BATCH), root / "critic.log", wait=False)
    reward = launch(ServerSpec(kind="reward", config=cfg, port=port + 10), root / "reward.log", wait=False)
    try:
        critic.wait_until_ready(120)
        reward.wait_until_ready(120)
        yield {"cfg": cfg, "critic": critic, "reward": reward}
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.stop(), (critic, reward)))


def test_ppo_step_over_http_matches_in_process(stack):
    """Runs first in this module: the server's critic is still at step 0, like the fresh in-process one."""

    cfg = stack["cfg"]
    batches = list(zip(range(2), prompt_batches(load_prompts(cfg), cfg.ppo.rollout_batch_size, cfg.seed)))

    def run(critic):
        state, history = build_actor(cfg), []
        try:
            for _, prompts in batches:
                history.append(train_step(state, prompts, cfg, Backends(critic=critic), gold_function(cfg))[0])
        finally:
            critic.close()
        return history

    local = run(LocalCritic(build_critic_trainer(cfg)))
    remote_client = critic_backend(cfg, stack["critic"].url)
    assert_implements(remote_client, CriticBackend) and remote_client.combined_reward
    remote = run(remote_client)
    for i, (a, b) in enumerate(zip(local, remote)):
        keys = sorted(k for k in a if not k.startswith(NON_DETERMINISTIC))
        assert keys == sorted(k for k in b if not k.startswith(NON_DETERMINISTIC))
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), f"iteration {i}: {key}"
    assert remote[-1]["critic/step"] == local[-1]["critic/step"] > 0


def raw_values(url, tokens, lengths):
    import tritonclient.http as http

    client = http.InferenceServerClient(url.split("://")[1])
    items = []
    for name, array in (("tokens", tokens), ("sequence_lengths", lengths.reshape(-1, 1))):
        item = http.InferInput(name, list(array.shape), "INT64")
        item.set_data_from_numpy(np.ascontiguousarray(array))
        items.append(item)
    out = client.infer("critic_infer", items,
                       headers=request_headers(read_secret(), "POST", "/v2/models/critic_infer/infer"))
    client.close()
    return out.as_numpy("values"), out.as_numpy("rewards")


def sequences(seed, B, L=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, (B, L), generator=g), torch.randint(3, L + 1, (B,), generator=g)


def test_critic_client_surface(stack):
    client = CriticClient(stack["critic"].url, timeout_s=60)
    try:
        assert client.combined_reward is True
        tokens, lengths = sequences(0, 40)  # more than the server's max_batch_size: split and concatenated
        values, rewards = client.infer_async(tokens, lengths).result(timeout=60)
        assert values.dtype == torch.float32 and values.shape == (40, 10) and rewards.shape == (40,)
        ref_values, ref_rewards = zip(*(raw_values(stack["critic"].url, tokens[s:s + MAX_BATCH].numpy(),
                                                   lengths[s:s + MAX_BATCH].numpy()) for s in range(0, 40, MAX_BATCH)))
        np.testing.assert_array_equal(values.numpy(), np.concatenate(ref_values))
        np.testing.assert_array_equal(rewards.numpy(), np.concatenate(ref_rewards)[:, 0])

        mask = (torch.arange(10)[None, :] < lengths[:, None]).float()
        training = client.train_async(tokens, mask * 0.3, values, mask)
        saved = client.save()  # waits for the training submitted before it
        stats = training.result(timeout=1)
        assert {"loss_mean", "grad_norm", "explained_variance", "clipfrac", "lr", "step"} <= set(stats)
        assert isinstance(stats["step"], int) and stats["step"] > 0 and np.isfinite(stats["loss_mean"])
        assert saved == {"status": 0, "step": stats["step"], "path": str(stack["cfg"].resolved_state_dir() / "critic")}
    finally:
        client.close()


def _failure_count(proc, model):
    path = f"/v2/models/{model}/stats"
    request = urllib.request.Request(f"{proc.url}{path}", headers=request_headers(proc.secret, "GET", path))
    stats = json.loads(urllib.request.urlopen(request, timeout=5).read())
    return int(stats["model_stats"][0]["inference_stats"]["fail"]["count"])


def test_server_errors_raise_with_the_servers_message_and_are_not_retried(stack):
    client = CriticClient(stack["critic"].url, timeout_s=60, retries=3)
    try:
        tokens, lengths = sequences(1, 4)
        failures = _failure_count(stack["critic"], "critic_infer")
        with pytest.raises(ServerError) as err:
            client.infer(tokens + 1000, lengths)  # ids beyond the vocabulary: only the server knows its vocab
        assert str(err.value).startswith("critic_infer: CriticInputError: tokens: ids must be in [0, ")
        assert "Traceback" in err.value.detail
        assert _failure_count(stack["critic"], "critic_infer") == failures + 1  # sent once, not retried
        with pytest.raises(CriticInputError, match="sequence_lengths"):  # refused before sending
            client.infer_async(tokens, lengths * 0).result(timeout=10)
        with pytest.raises(CriticInputError, match="mask"):
            client.train(tokens, torch.zeros(4, 10), torch.zeros(4, 10), torch.full((4, 10), 0.5))
        assert _failure_count(stack["critic"], "critic_infer") == failures + 1
    finally:
        client.close()


def test_connection_refused_is_retried_then_raises():
    port = find_free_ports()
    client = CriticClient(f"http://127.0.0.1:{port}", timeout_s=5, retries=2, combined_reward=True)
    client._http.retry_wait_s = 0.2
    waits = []
    client._http._sleep = waits.append
    try:
        with pytest.raises(ServerUnavailable, match=f"cannot reach 127.0.0.1:{port}.*after 3 attempt"):
            client.infer_async(*sequences(2, 2)).result(timeout=30)
        assert waits == pytest.approx([0.2, 0.4])  # a growing wait between the attempts
    finally:
        client.close()


def test_summarize_server_error_picks_the_raised_error():
    detail = ("Failed to process the request(s) for model 'critic_infer_0_0', message: TritonModelException: Model "
              "execute error: Traceback (most recent call last):\n  File \"x\", line 1\n"
              "c_python_backend_utils.TritonModelException: Traceback (most recent call last):\n"
              "models.critic.CriticInputError: mask: values must be 0 or 1\n\nAt:\n  model.py(501): execute\n")
    assert summarize_server_error(detail) == "CriticInputError: mask: values must be 0 or 1"
    plain = "Request for unknown model: 'x' is not found"
    assert summarize_server_error(plain) == plain


def test_reward_client_matches_the_reward_model(stack, tiny_models):
    from models.reward import load_reward_model, reward_model_scores

    client = reward_backend(stack["cfg"], stack["reward"].url)
    try:
        assert_implements(client, RewardBackend)
        tokens, lengths = sequences(3, 20)
        scores = client.score_async(tokens, lengths, torch.full((20,), 2), ["p"] * 20, ["r"] * 20).result(timeout=60)
        local = reward_model_scores(load_reward_model(tiny_models["reward"]), tokens, lengths)
        assert scores.shape == (20,) and scores.dtype == torch.float32
        torch.testing.assert_close(scores, local, rtol=1e-5, atol=1e-6)
    finally:
        client.close()


def test_critic_and_reward_servers_run_side_by_side(stack):
    critic, reward = stack["critic"], stack["reward"]
    homes = {psutil.Process(p.pid).environ()["PYTRITON_HOME"] for p in (critic, reward)}
    assert len(homes) == 2  # each server has its own PyTriton home / workspace
    batches = [sequences(10 + i, 8) for i in range(6)]
    with CriticClient(critic.url, max_workers=4) as cc, RewardClient(reward.url, max_workers=4) as rc:
        reference = [(cc.infer(t, n), rc.score(t, n)) for t, n in batches]
        # everything in flight at once, on both servers
        futures = [(cc.infer_async(t, n), rc.score_async(t, n, None, [], [])) for t, n in batches for _ in range(3)]
        for i, (fc, fr) in enumerate(futures):
            (values, rewards), scores = fc.result(timeout=120), fr.result(timeout=120)
            ref_critic, ref_scores = reference[i // 3]
            torch.testing.assert_close(values, ref_critic[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rewards, ref_scores, rtol=1e-5, atol=1e-6)  # combined RM == reward server
    assert critic.poll() is None and reward.poll() is None
