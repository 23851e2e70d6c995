"""The critic and reward servers against their wire contract, with raw tritonclient.http calls (not our client)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from components.launch.processes import find_free_ports
from components.serving.auth import read_secret, request_headers
from components.serving.launcher import triton_server
from components.serving.triton.contract import CRITIC_MODELS, REWARD_MODELS, TEACHER_LOGPROBS, critic_specs
from components.serving.triton.critic import CriticCallables
from components.serving.triton.reward import RewardCallables

TRAIN_SETTINGS = ["--set", "critic.optim.lr=1e-3", "--set", "critic.train_batch_size=16", "--set", "critic.epochs=2"]


def critic_argv(tiny, port, checkpoint_dir, store):
    """`rlhf serve critic` as a user types it (the flags, not the launcher's JSON spec)."""
    return [sys.executable, "-m", "components.cli.main", "serve", "critic", "--preset", "tiny", "--model",
            tiny["critic"], "--reward", tiny["reward"], "--port", str(port), "--checkpoint-dir", str(checkpoint_dir),
            "--set", "deploy.critic.max_queue_delay_us=500", "--checkpoint-uri", store.as_uri(), *TRAIN_SETTINGS]


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    """A combined critic server (with a checkpoint dir) and a reward-model server carrying a teacher, started side by
    side."""
    logs = tmp_path_factory.mktemp("server-logs")
    critic_port, reward_port = find_free_ports(), find_free_ports()
    while abs(reward_port - critic_port) < 3:
        reward_port = find_free_ports()
    ckpt = tmp_path_factory.mktemp("critic-ckpt") / "critic"
    store = tmp_path_factory.mktemp("store")
    critic = triton_server(critic_argv(tiny_models, critic_port, ckpt, store), "127.0.0.1", critic_port, CRITIC_MODELS,
                           logs / "critic.log", name="critic")
    # the reward server of an on-policy distillation run serves its teacher too (teacher_logprobs)
    reward = triton_server([sys.executable, "-m", "components.cli.main", "serve", "reward", "--preset", "tiny",
                            "--model", tiny_models["reward"],
                            "--port", str(reward_port), "--set", "algorithm=opd", "--set",
                            f"model.teacher={tiny_models['policy']}"], "127.0.0.1", reward_port,
                           REWARD_MODELS + (TEACHER_LOGPROBS,), logs / "reward.log", name="reward")
    state = {"critic": critic, "reward": reward, "ckpt": ckpt, "store": store, "logs": logs}
    try:
        critic.wait_until_ready(120)
        reward.wait_until_ready(120)
        yield state
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.stop(), (state["critic"], reward)))


def infer_input(name, array, dtype=None):
    dtype = dtype or {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
                      np.dtype(np.int32): "INT32"}[array.dtype]
    item = http.InferInput(name, list(array.shape), dtype)
    item.set_data_from_numpy(array)
    return item


def signed(method: str, path: str) -> dict:
    """The run's signature of one request (the servers were given the tests' run secret)."""
    return request_headers(read_secret(), method, path)


def raw(url, model, headers=None, **arrays):
    client = http.InferenceServerClient(url.split("://")[1])
    try:
        result = client.infer(model, [infer_input(k, v) for k, v in arrays.items()],
                              headers=signed("POST", f"/v2/models/{model}/infer") if headers is None else headers)
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
    finally:
        client.close()


def batch(seed=0, B=8, L=12, vocab=40):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (B, L)).astype(np.int64)
    lengths = rng.integers(3, L + 1, (B, 1)).astype(np.int64)
    lengths[0, 0] = L
    return tokens, lengths


def test_critic_infer_contract_shapes_and_dtypes(servers):
    tokens, lengths = batch()
    out = raw(servers["critic"].url, "critic_infer", tokens=tokens, sequence_lengths=lengths)
    assert out["values"].shape == tokens.shape and out["values"].dtype == np.float32
    assert out["rewards"].shape == (tokens.shape[0], 1) and out["rewards"].dtype == np.float32
    beyond = np.arange(tokens.shape[1])[None, :] >= lengths
    assert np.all(out["values"][beyond] == 0) and np.any(out["values"][~beyond] != 0)

    client = http.InferenceServerClient(servers["critic"].url.split("://")[1])
    infer_cfg, train_cfg, save_cfg = (client.get_model_config(m, headers=signed("GET", f"/v2/models/{m}/config"))
                                      for m in CRITIC_MODELS)
    client.close()
    assert infer_cfg["max_batch_size"] > 0 and "dynamic_batching" in infer_cfg
    assert {i["name"]: i["dims"] for i in infer_cfg["input"] if not i.get("optional")} == {"tokens": [-1],
                                                                                          "sequence_lengths": [1]}
    assert train_cfg["max_batch_size"] == 0 and save_cfg["max_batch_size"] == 0
    assert {o["name"] for o in train_cfg["output"]} >= {"loss_mean", "grad_norm", "explained_variance", "step"}
    assert [i["name"] for i in save_cfg["input"]] == ["dummy_var"]


def test_combined_rewards_equal_standalone_reward_model(servers, tiny_models):
    from models.reward import load_reward_model, reward_model_scores

    tokens, lengths = batch(seed=1)
    combined = raw(servers["critic"].url, "critic_infer", tokens=tokens, sequence_lengths=lengths)["rewards"]
    served = raw(servers["reward"].url, "reward_model", tokens=tokens, sequence_lengths=lengths)["rewards"]
    local = reward_model_scores(load_reward_model(tiny_models["reward"]), torch.from_numpy(tokens),
                                torch.from_numpy(lengths[:, 0])).numpy()
    assert served.shape == (tokens.shape[0], 1) and served.dtype == np.float32
    np.testing.assert_allclose(combined[:, 0], local, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served[:, 0], local, rtol=1e-5, atol=1e-6)
    # a model reward ignores the optional prompt_lengths
    prompts = np.minimum(lengths, 2)
    with_prompts = raw(servers["reward"].url, "reward_model", tokens=tokens, sequence_lengths=lengths,
                       prompt_lengths=prompts)["rewards"]
    np.testing.assert_allclose(with_prompts, served, rtol=1e-6)


def test_the_teacher_s_logprobs_are_its_own_over_the_wire(servers, tiny_models):
    """On-policy distillation's teacher in the reward server: `teacher_logprobs` answers the teacher's logprob of each
    next token [B, L-1], 0 past each row's length, equal to the teacher's in this process (raw tritonclient and our
    client, which splits requests at the model's max batch size); a bad request is refused naming the tensor."""
    from components.serving.triton.clients import RewardClient
    from models.scoring import load_teacher, teacher_logprobs

    tokens, lengths = batch(seed=4, B=5, L=9)
    served = raw(servers["reward"].url, TEACHER_LOGPROBS, tokens=tokens, sequence_lengths=lengths)["logprobs"]
    local = teacher_logprobs(load_teacher(tiny_models["policy"]), torch.from_numpy(tokens),
                             torch.from_numpy(lengths[:, 0])).numpy()
    assert served.shape == (5, 8) and served.dtype == np.float32 and np.abs(local).sum() > 0
    np.testing.assert_allclose(served, local, rtol=1e-5, atol=1e-6)
    assert (served[np.arange(8)[None, :] >= lengths - 1] == 0).all()
    client = RewardClient(servers["reward"].url, secret=read_secret())
    try:
        client._teacher_batch = 2  # three requests
        np.testing.assert_allclose(client.teacher_logprobs(tokens, lengths[:, 0]).numpy(), local, rtol=1e-5, atol=1e-6)
    finally:
        client.close()
    bad = tokens.copy()
    bad[0, 0] = 10_000
    with pytest.raises(InferenceServerException, match="tokens"):
        raw(servers["reward"].url, TEACHER_LOGPROBS, tokens=bad, sequence_lengths=lengths)


TOK, LEN = batch(seed=2, B=4, L=6)
MASK = (np.arange(6)[None, :] < LEN).astype(np.float32)
GOOD_TRAIN = {"tokens": TOK, "returns": np.ones((4, 6), np.float32) * MASK, "prev_values": np.zeros((4, 6), np.float32),
              "mask": MASK}


def _train(**changes):
    return {**GOOD_TRAIN, **changes}


BAD_REQUESTS = [
    # (id, model, inputs, words the error must contain)
    ("dtype", "critic_infer", {"tokens": TOK.astype(np.int32), "sequence_lengths": LEN}, ["tokens", "INT64"]),
    ("rank", "critic_infer", {"tokens": TOK[:, :, None], "sequence_lengths": LEN}, ["tokens", "shape"]),
    ("batch-mismatch", "critic_infer", {"tokens": TOK, "sequence_lengths": LEN[:3]}, ["batch size"]),
    ("length-too-long", "critic_infer", {"tokens": TOK, "sequence_lengths": LEN + 6}, ["sequence_lengths", "[1, L=6]"]),
    ("length-zero", "critic_infer", {"tokens": TOK, "sequence_lengths": LEN * 0}, ["sequence_lengths", "[1, L=6]"]),
    ("empty-batch", "critic_infer", {"tokens": TOK[:0], "sequence_lengths": LEN[:0]}, ["sequence_lengths"]),
    ("empty-length", "critic_infer", {"tokens": TOK[:, :0], "sequence_lengths": LEN}, ["tokens", "non-empty"]),
    ("token-id", "critic_infer", {"tokens": TOK + 10_000, "sequence_lengths": LEN}, ["tokens", "ids must be in"]),
    ("nan-returns", "critic_train", _train(returns=GOOD_TRAIN["returns"] * np.nan), ["returns", "NaN"]),
    ("inf-prev-values", "critic_train", _train(prev_values=GOOD_TRAIN["prev_values"] + np.inf), ["prev_values", "Inf"]),
    ("mask-not-binary", "critic_train", _train(mask=MASK * 0.5), ["mask", "0 or 1"]),
    ("returns-shape", "critic_train", _train(returns=GOOD_TRAIN["returns"][:, :5]), ["returns", "shape"]),
    ("returns-dtype", "critic_train", _train(returns=GOOD_TRAIN["returns"].astype(np.float64)), ["returns", "FP32"]),
    ("train-empty", "critic_train", _train(**{k: v[:0] for k, v in GOOD_TRAIN.items()}), ["tokens", "non-empty"]),
    ("train-missing", "critic_train", {k: v for k, v in GOOD_TRAIN.items() if k != "mask"}, ["mask"]),
    ("unknown-model", "critic_nope", {"tokens": TOK, "sequence_lengths": LEN}, ["critic_nope", "unknown model"]),
]


def test_bad_requests_are_refused_by_name_and_change_nothing(servers):
    url = servers["critic"].url
    probe_tokens, probe_lengths = batch(seed=3)
    before = raw(url, "critic_infer", tokens=probe_tokens, sequence_lengths=probe_lengths)
    for case, model, inputs, words in BAD_REQUESTS:
        with pytest.raises(InferenceServerException) as err:
            raw(url, model, **inputs)
        message = err.value.message()
        for word in words:
            assert word in message, f"{case}: {word!r} not in {message[:400]!r}"
        # the server keeps serving the next good request, with unchanged weights
        after = raw(url, "critic_infer", tokens=probe_tokens, sequence_lengths=probe_lengths)
        np.testing.assert_array_equal(after["values"], before["values"], err_msg=case)
    assert servers["critic"].poll() is None


def test_training_lowers_the_loss_and_moves_values_to_the_returns(servers):
    url = servers["critic"].url
    tokens, lengths = batch(seed=4, B=32, L=10)
    mask = (np.arange(10)[None, :] < lengths).astype(np.float32)
    returns = (np.where(tokens % 2 == 0, 1.0, -1.0) * mask).astype(np.float32)
    start = raw(url, "critic_infer", tokens=tokens, sequence_lengths=lengths)["values"]
    losses, steps = [], []
    for _ in range(6):
        values = raw(url, "critic_infer", tokens=tokens, sequence_lengths=lengths)["values"]
        out = raw(url, "critic_train", tokens=tokens, returns=returns, prev_values=values, mask=mask)
        assert out["loss_mean"].shape == (1,) and out["loss_mean"].dtype == np.float32
        assert out["step"].dtype == np.int64 and np.isfinite(out["grad_norm"]).all()
        losses.append(float(out["loss_mean"][0]))
        steps.append(int(out["step"][0]))
    end = raw(url, "critic_infer", tokens=tokens, sequence_lengths=lengths)["values"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert steps == sorted(steps) and steps[1] - steps[0] == 4  # 32 rows / batch 16 x 2 epochs
    err_start = np.abs((start - returns) * mask).sum() / mask.sum()
    err_end = np.abs((end - returns) * mask).sum() / mask.sum()
    assert err_end < 0.8 * err_start, (err_start, err_end)


def test_save_stop_restart_restores_step_and_weights(servers, tiny_models):
    critic = servers["critic"]
    tokens, lengths = batch(seed=5)
    mask = (np.arange(tokens.shape[1])[None, :] < lengths).astype(np.float32)
    trained = raw(critic.url, "critic_train", tokens=tokens, returns=mask * 0.5, prev_values=mask * 0, mask=mask)
    saved = raw(critic.url, "critic_save", dummy_var=np.zeros(1, np.int64))
    assert saved["status"].tolist() == [0] and saved["status"].dtype == np.int64
    assert saved["step"].tolist() == trained["step"].tolist()
    assert (servers["ckpt"] / "critic_state.pt").exists() and (servers["ckpt"] / "model").is_dir()
    # --checkpoint-uri: the save is also uploaded to the checkpoint store (for the next checkpoint to adopt), and its
    # location returned
    step = int(saved["step"][0])
    assert saved["path"][0].decode() == f"{servers['store'].as_uri()}/critic-pending/step-{step}"
    assert (servers["store"] / "critic-pending" / f"step-{step}" / "critic_state.pt").exists()
    assert (servers["store"] / "critic-pending" / f"step-{step}.sha256.json").exists()
    before = raw(critic.url, "critic_infer", tokens=tokens, sequence_lengths=lengths)

    members = critic.group_members()
    assert critic.stop() == 0  # graceful: SIGTERM, PyTriton unloads the models and stops tritonserver
    assert len(members) >= 5 and not critic.group_members()  # server, tritonserver, 3 stubs: all gone
    assert all(not m.is_running() or m.status() == "zombie" for m in members)
    argv = critic_argv(tiny_models, critic.port, servers["ckpt"], servers["store"])
    restarted = triton_server(argv, "127.0.0.1", critic.port, CRITIC_MODELS, servers["logs"] / "critic-restarted.log",
                              name="critic")
    servers["critic"] = restarted  # the fixture stops it
    restarted.wait_until_ready(120)  # same port: the old server freed it
    after = raw(restarted.url, "critic_infer", tokens=tokens, sequence_lengths=lengths)
    # restored weights are the saved bytes; a new process may still pick other GEMM kernels (alignment): ulp-level
    np.testing.assert_allclose(after["values"], before["values"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(after["rewards"], before["rewards"], rtol=1e-6, atol=1e-6)
    again = raw(restarted.url, "critic_train", tokens=tokens, returns=mask * 0.5, prev_values=after["values"],
                mask=mask)
    # resumed from the saved step (8 rows: 1 batch x 2 epochs)
    assert int(again["step"][0]) == int(saved["step"][0]) + 2


class _WordTokenizer:
    """Enough of a tokenizer for RewardCallables: ids are indices into a word list."""

    words = ["<pad>", "<eos>", "good", "bad", "movie", "was"]

    def __len__(self):
        return len(self.words)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i < 2))


def test_function_reward_decodes_prompt_and_response_from_tokens():
    seen, seen_columns = [], []

    def reward(prompts, responses, columns):  # as models.reward.load_reward_function wraps a function
        seen.append((prompts, responses))
        seen_columns.append(columns)
        return [float(r.count("good")) for r in responses]

    callables = RewardCallables(function=reward, tokenizer=_WordTokenizer())
    tokens = np.array([[4, 5, 2, 2, 1, 0], [4, 5, 3, 1, 0, 0]], dtype=np.int64)
    lengths = np.array([[5], [4]], dtype=np.int64)
    out = callables.infer([{"tokens": tokens, "sequence_lengths": lengths,
                            "prompt_lengths": np.array([[2], [2]], dtype=np.int64)}])
    assert seen[-1] == (["movie was", "movie was"], ["good good", "bad"])
    assert out[0]["rewards"].tolist() == [[2.0], [0.0]] and out[0]["rewards"].dtype == np.float32
    # without prompt_lengths (NeMo-Aligner clients) the whole sequence is the response
    callables.infer([{"tokens": tokens, "sequence_lengths": lengths}])
    assert seen[-1] == (["", ""], ["movie was good good", "movie was bad"])
    with pytest.raises(ValueError, match="prompt_lengths"):
        callables.infer([{"tokens": tokens, "sequence_lengths": lengths,
                          "prompt_lengths": np.array([[2], [9]], dtype=np.int64)}])
    # the optional `columns` input: each row's data set columns (JSON), to the function; none sent: empty rows
    assert seen_columns[-2] == [{}, {}]
    rows = [{"target": "positive", "answer": 1}, {"target": "negative", "answer": None}]
    columns = np.array([[json.dumps(r).encode()] for r in rows], dtype=np.object_)
    callables.infer([{"tokens": tokens, "sequence_lengths": lengths, "columns": columns}])
    assert seen_columns[-1] == rows
    callables.text([{"prompts": np.array([[b"p"], [b"q"]], dtype=np.object_),
                     "responses": np.array([[b"good"], [b"bad"]], dtype=np.object_), "columns": columns}])
    assert seen[-1] == (["p", "q"], ["good", "bad"]) and seen_columns[-1] == rows
    for bad, message in ((np.array([[b"[1]"], [b"{}"]], dtype=np.object_), "columns: item 0 must be a JSON object"),
                         (np.array([[b"{"], [b"{}"]], dtype=np.object_), "columns: item 0 is not JSON"),
                         (np.array([[b"{}"]], dtype=np.object_), "columns: batch size 1 does not match")):
        with pytest.raises(ValueError, match=message):
            callables.infer([{"tokens": tokens, "sequence_lengths": lengths, "columns": bad}])


def test_critic_without_reward_model_serves_values_only_and_pads_mixed_lengths(tiny_models):
    """--no-combine: no `rewards` output; requests of different L in one batch are padded, then cut back."""
    from models.config import CriticConfig
    from models.critic import CriticTrainer

    infer_spec = critic_specs(False, 8, 0)[0]
    assert [t.name for t in infer_spec.outputs] == ["values"] and infer_spec.max_batch_size == 8
    callables = CriticCallables(CriticTrainer(CriticConfig(), tiny_models["critic"], None, False))
    assert callables.trainer.reward_model is None
    (t1, l1), (t2, l2) = batch(seed=6, B=3, L=7), batch(seed=7, B=2, L=12)
    together = callables.infer([{"tokens": t1, "sequence_lengths": l1}, {"tokens": t2, "sequence_lengths": l2}])
    alone = [callables.infer([{"tokens": t, "sequence_lengths": n}])[0] for t, n in ((t1, l1), (t2, l2))]
    assert [set(r) for r in together] == [{"values"}, {"values"}]
    assert together[0]["values"].shape == (3, 7) and together[1]["values"].shape == (2, 12)
    for joint, single in zip(together, alone):
        np.testing.assert_allclose(joint["values"], single["values"], rtol=1e-5, atol=1e-6)
