"""NeMo-Aligner's own PPO critic client against our critic server (issue 18, "a wire-contract bug").

Requests are built the way NeMo-Aligner's `RemoteGPTRMCriticClient` (nemo_aligner/models/nlp/gpt/
reward_critic_clients.py) and its PPO trainer (nemo_aligner/algorithms/ppo.py) build them, and sent the way its
`HTTPCommunicator` sends them: a pytriton `FuturesModelClient` per model, `infer_batch` for critic_infer and
`infer_sample` (no batch axis added) for critic_train and critic_save.

- critic_infer: `tokens` int64 [B, S] (the generation's tokens, padded with EOS, then with 0 up to `pad_to_length`),
  `sequence_lengths` int64 [B, 1] (prompt + response lengths, `response_lengths.unsqueeze(1)`); the client keeps
  `values[:, :S-1]` and `rewards.flatten()`.
- critic_train: `tokens` int64 [B, S]; `returns`, `prev_values` (the rollout's values) and `mask` float32 [B, S-1],
  per action: position t is the value of tokens[:t+1] (the state before action t+1); the mask is 1 from
  prompt_length-1 to response_length-2; the reward sits at response_length-2.
- critic_save: `dummy_var` = np.array([0]) (int64 [1]); the client only waits for the answer.

NeMo-Aligner's client sends no credentials: the servers here run in open mode (deploy.critic.auth=none), which says
so when it starts, serves inference, model config and metadata to anyone, keeps statistics and the repository summary
for requests signed with the run's key, and Triton's admin APIs closed to everyone; a server in the default mode
refuses that client (tests/components/serving/test_server_security.py).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as http
from pytriton.client import FuturesModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError
from tritonclient.utils import InferenceServerException

from components.launch.processes import find_free_ports
from components.serving.auth import request_headers
from components.serving.launcher import triton_server
from components.serving.triton.contract import CRITIC_MODELS

B, S, PAD_TO = 12, 28, 32  # batch, rollout sequence length, the client's pad_to_length for critic_infer
TOL = dict(rtol=1e-6, atol=1e-6)  # two processes may pick other GEMM kernels (alignment): ulp-level differences


def critic_argv(tiny, port, checkpoint_dir):
    """`rlhf serve critic` as a user types it; a long queue delay so concurrent critic_infer requests meet in Triton's
    dynamic batcher; 12 rows / batch 4 x 2 epochs = 6 optimizer steps per critic_train."""
    return [sys.executable, "-m", "components.cli.main", "serve", "critic", "--preset", "tiny", "--model",
            tiny["critic"],
            "--reward", tiny["reward"], "--port", str(port),
            "--checkpoint-dir", str(checkpoint_dir), "--set", f"model.policy={tiny['policy']}",
            "--set", "deploy.critic.max_queue_delay_us=100000",
            "--set", "critic.optim.lr=1e-3", "--set", "critic.train_batch_size=4", "--set", "critic.epochs=2",
            "--set", "deploy.critic.auth=none"]  # open mode: NeMo-Aligner's client sends no credentials


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    """Two fresh critic servers from the same weights and settings: `a` is trained in NeMo-Aligner's per-action layout,
    `b` with the same arrays in our [B, S] layout."""
    logs = tmp_path_factory.mktemp("nemo-contract-logs")
    ports = [find_free_ports()]
    while len(ports) < 2:
        port = find_free_ports()
        if abs(port - ports[0]) >= 3:
            ports.append(port)
    servers = {}
    try:
        for name, port in zip("ab", ports):
            ckpt = tmp_path_factory.mktemp(f"critic-{name}") / "critic"
            servers[name] = triton_server(critic_argv(tiny_models, port, ckpt), "127.0.0.1", port, CRITIC_MODELS,
                                          logs / f"critic-{name}.log", name=f"critic-{name}")
            servers[name].ckpt = ckpt
        for server in servers.values():
            server.wait_until_ready(180)
        yield servers
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.stop(), servers.values()))


# ---------------------------------------------------------------- NeMo-Aligner's client, as it sends

def send(url: str, model: str, batching: bool, **data: np.ndarray) -> dict[str, np.ndarray]:
    """HTTPCommunicator.send_data_to_server: infer_batch when batching, else infer_sample; the caller waits."""
    with FuturesModelClient(url, model, init_timeout_s=60, inference_timeout_s=300) as client:
        future = client.infer_batch(**data) if batching else client.infer_sample(**data)
        return future.result()


def refused(url: str, model: str, batching: bool, **data: np.ndarray) -> str:
    with pytest.raises(PyTritonClientInferenceServerError) as err:
        send(url, model, batching, **data)
    return str(err.value)


def rollout(tiny_models, seed: int = 0) -> dict[str, np.ndarray]:
    """A PPO rollout batch as NeMo-Aligner holds it: prompt + response tokens [B, S] padded with EOS; lengths [B]."""
    config = json.loads((Path(tiny_models["critic"]) / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), int(config["eos_token_id"])
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(3, 7, B)
    response_lengths = rng.integers(prompt_lengths + 2, S + 1)  # prompt + response, the EOS included
    response_lengths[0] = S
    tokens = rng.integers(4, vocab, (B, S)).astype(np.int64)
    for i, n in enumerate(response_lengths):
        tokens[i, n - 1:] = eos
    return {"response_tokens": tokens, "prompt_lengths": prompt_lengths, "response_lengths": response_lengths}


def infer_rm_critic(url: str, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """RemoteGPTRMCriticClient.infer_rm_critic (+ RMCriticFutureResult): tokens zero-padded to pad_to_length,
    sequence_lengths [B, 1]; values cut back to the per-action [B, S-1]."""
    tokens = batch["response_tokens"]
    padded = np.pad(tokens, ((0, 0), (0, PAD_TO - tokens.shape[1])), constant_values=0)
    out = send(url, "critic_infer", True, tokens=padded,
               sequence_lengths=batch["response_lengths"][:, None].astype(np.int64))
    assert out["values"].shape == (B, PAD_TO) and out["rewards"].shape == (B, 1)
    return out["rewards"].flatten(), out["values"][:, :tokens.shape[1] - 1]


def ppo_critic_data(batch, rewards, values, discount=1.0, lam=0.95) -> dict[str, np.ndarray]:
    """What PPOTrainer.generate_ppo_data hands to the critic: mask, returns (GAE) and values, all per action."""
    mask = np.zeros_like(values)
    for i, (p, n) in enumerate(zip(batch["prompt_lengths"], batch["response_lengths"])):
        mask[i, p - 1:n - 1] = 1.0  # from the first response action to the EOS
    token_rewards = np.zeros_like(values)
    token_rewards[np.arange(B), np.clip(batch["response_lengths"] - 2, 0, None)] = rewards
    v, r = values * mask, token_rewards * mask
    advantages, running = np.zeros_like(v), np.zeros(B, np.float32)
    for t in reversed(range(v.shape[1])):
        following = v[:, t + 1] if t + 1 < v.shape[1] else 0.0
        running = r[:, t] + discount * following - v[:, t] + discount * lam * running
        advantages[:, t] = running
    return {"returns": (advantages + v).astype(np.float32), "values": values.astype(np.float32),
            "mask": mask.astype(np.float32)}


def train_request(batch, data) -> dict[str, np.ndarray]:
    """RemoteGPTRMCriticClient.train: tokens int64 [B, S]; returns, prev_values, mask float32 [B, S-1]."""
    return {"tokens": batch["response_tokens"].astype(np.int64), "returns": data["returns"],
            "prev_values": data["values"], "mask": data["mask"]}


def token_layout(request) -> dict[str, np.ndarray]:
    """The same request in our [B, S] layout (what our own PPO client sends): a zero, masked, last column."""
    return {k: v if k == "tokens" else np.pad(v, ((0, 0), (0, 1))) for k, v in request.items()}


# ---------------------------------------------------------------- the contract

def test_model_configs_declare_nemo_aligners_inputs(pair):
    client = http.InferenceServerClient(pair["a"].url.split("://")[1])
    try:
        infer_cfg, train_cfg = (client.get_model_config(m) for m in ("critic_infer", "critic_train"))
    finally:
        client.close()
    infer = {i["name"]: (i["data_type"], i["dims"], bool(i.get("optional"))) for i in infer_cfg["input"]}
    assert infer == {"tokens": ("TYPE_INT64", [-1], False), "sequence_lengths": ("TYPE_INT64", [1], False),
                     "sentences": ("TYPE_STRING", [-1], True), "add_EOS": ("TYPE_BOOL", [1], True)}
    train = {i["name"]: (i["data_type"], i["dims"]) for i in train_cfg["input"]}
    assert train == {"tokens": ("TYPE_INT64", [-1, -1]), **{n: ("TYPE_FP32", [-1, -1])
                                                           for n in ("returns", "prev_values", "mask")}}


def test_per_action_train_is_accepted_and_trains_like_the_token_layout(pair, tiny_models):
    a, b = pair["a"].url, pair["b"].url
    for round_ in range(2):  # two PPO steps: the second trains from the values the first one moved
        batch = rollout(tiny_models, seed=round_)
        rewards, values = infer_rm_critic(a, batch)
        rewards_b, values_b = infer_rm_critic(b, batch)
        np.testing.assert_allclose(values_b, values, **TOL)  # the two servers hold the same weights
        np.testing.assert_allclose(rewards_b, rewards, **TOL)
        request = train_request(batch, ppo_critic_data(batch, rewards, values))
        assert request["tokens"].shape == (B, S) and request["returns"].shape == (B, S - 1)
        assert request["mask"].sum() > 0

        per_action = send(a, "critic_train", False, **request)
        token = send(b, "critic_train", False, **token_layout(request))
        assert per_action["loss_mean"].shape == (1,) and per_action["loss_mean"].dtype == np.float32
        assert int(per_action["step"][0]) == int(token["step"][0]) == 6 * (round_ + 1)
        for stat in ("loss_mean", "grad_norm", "explained_variance", "clipfrac", "lr"):
            np.testing.assert_allclose(per_action[stat], token[stat], **TOL, err_msg=stat)

        trained_a, trained_b = infer_rm_critic(a, batch)[1], infer_rm_critic(b, batch)[1]
        np.testing.assert_allclose(trained_a, trained_b, **TOL)
        assert np.abs(trained_a - values).max() > 1e-3  # it did train (the equality is not that of untouched weights)


@pytest.mark.parametrize("case, change, words", [
    ("returns-too-short", {"returns": lambda r: r["returns"][:, :-1]}, ["returns", f"[{B}, {S}]", f"[{B}, {S - 1}]"]),
    ("mask-too-long", {"mask": lambda r: np.pad(r["mask"], ((0, 0), (0, 2)))},
     ["mask", f"[{B}, {S}]", f"[{B}, {S - 1}]"]),
    ("prev-values-other-layout", {"prev_values": lambda r: np.pad(r["prev_values"], ((0, 0), (0, 1)))},
     ["prev_values", "share one layout", f"[{B}, {S}]", f"[{B}, {S - 1}]"]),
    ("returns-other-batch", {"returns": lambda r: r["returns"][:-1]}, ["returns", f"[{B}, {S - 1}]"]),
])
def test_other_widths_are_refused_by_name_and_change_nothing(pair, tiny_models, case, change, words):
    url = pair["a"].url
    batch = rollout(tiny_models, seed=7)
    rewards, values = infer_rm_critic(url, batch)
    request = train_request(batch, ppo_critic_data(batch, rewards, values))
    bad = {**request, **{name: fn(request) for name, fn in change.items()}}
    message = refused(url, "critic_train", False, **bad)
    for word in words:
        assert word in message, f"{case}: {word!r} not in {message[:500]!r}"
    # the server keeps serving, with unchanged weights
    np.testing.assert_array_equal(infer_rm_critic(url, batch)[1], values)
    assert pair["a"].poll() is None


def test_infer_refuses_sentences_and_add_eos_by_name_alone(pair, tiny_models):
    url = pair["a"].url
    batch = rollout(tiny_models, seed=8)
    tokens, lengths = batch["response_tokens"], batch["response_lengths"][:, None].astype(np.int64)
    texts = np.array([[b"the movie was good"]] * B, dtype=np.object_)
    message = refused(url, "critic_infer", True, tokens=tokens, sequence_lengths=lengths, sentences=texts)
    assert "sentences" in message and "not supported" in message and "reward_text" in message, message[:500]
    message = refused(url, "critic_infer", True, tokens=tokens, sequence_lengths=lengths,
                      add_EOS=np.zeros((B, 1), dtype=np.bool_))
    assert "add_EOS" in message and "not supported" in message, message[:500]
    # text only, as NeMo-Aligner's own server would take it: Triton refuses it, naming what is missing
    message = refused(url, "critic_infer", True, sentences=texts)
    assert "sentences" in message and "missing required input(s) ['tokens','sequence_lengths']" in message, message

    # a refused request fails alone: Triton does not batch it with the token requests queued beside it
    alone = send(url, "critic_infer", True, tokens=tokens, sequence_lengths=lengths)["values"]

    def good(_):
        return send(url, "critic_infer", True, tokens=tokens, sequence_lengths=lengths)["values"]

    def bad(_):
        return refused(url, "critic_infer", True, tokens=tokens, sequence_lengths=lengths, sentences=texts)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fn, i) for i, fn in enumerate((good, bad, good, good))]
        results = [f.result() for f in futures]
    assert "sentences" in results[1]
    for values in (results[0], results[2], results[3]):
        np.testing.assert_allclose(values, alone, **TOL)
    assert pair["a"].poll() is None


def test_save_as_nemo_aligners_client_sends_it(pair):
    from safetensors.numpy import load_file

    saved = {name: send(server.url, "critic_save", False, dummy_var=np.array([0]))
             for name, server in pair.items()}
    for name, out in saved.items():
        assert out["status"].tolist() == [0], name
        assert (pair[name].ckpt / "critic_state.pt").exists() and (pair[name].ckpt / "model").is_dir()
    assert saved["a"]["step"].tolist() == saved["b"]["step"].tolist() == [12]
    # the critic trained on the per-action layout and the one trained on [B, S] saved the same weights
    weights_a, weights_b = (load_file(str(pair[n].ckpt / "model" / "model.safetensors")) for n in "ab")
    assert weights_a.keys() == weights_b.keys() and weights_a
    for key in weights_a:
        np.testing.assert_allclose(weights_a[key], weights_b[key], **TOL, err_msg=key)


def test_open_mode_says_so_and_keeps_the_admin_apis_closed(pair):
    server = pair["a"]
    assert "OPEN MODE (deploy.critic.auth=none)" in server.tail(400)
    client = http.InferenceServerClient(server.url.split("://")[1])
    try:
        assert client.get_model_config("critic_infer")["name"] == "critic_infer"  # open: what NeMo's client reads
        with pytest.raises(InferenceServerException, match="401.*authorization"):
            client.get_inference_statistics()  # statistics: the run's key only, also in open mode
        assert client.get_inference_statistics(headers=request_headers(server.secret, "GET", "/v2/models/stats"))
        for headers in ({}, request_headers(server.secret, "POST", "/v2/repository/index")):
            with pytest.raises(InferenceServerException, match="403.*closed to every caller"):
                client.get_model_repository_index(headers=headers)  # admin: nobody's
    finally:
        client.close()
