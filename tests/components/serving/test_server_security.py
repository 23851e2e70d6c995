"""The critic and reward servers serve their own run only, and no request can hurt them (issue 32's probes, against real
PyTriton servers started as a run starts them):
- a stranger (no token, or another run's) is refused on every API but liveness/readiness; NeMo-Aligner's client too
  unless the server runs in open mode (tests/components/serving/test_nemo_aligner_contract.py);
- an oversized body is refused by Triton; critic_train with returns of 3e38 is refused naming `returns`, and the
  critic's values stay finite; a critic_train over max_train_rows is refused naming `tokens`; a 5 MB reward_text is
  scored from the characters the model can see, as the same text's tail is;
- Hypothesis builds malformed tensors for every endpoint (wrong dtypes, ranks, shapes, missing and unknown inputs,
  NaN/Inf/huge values, bad UTF-8): each is refused with an error naming a tensor, and the run's own requests are
  served afterwards;
- a server whose run is SIGKILLed stops, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as http
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from pytriton.client import ModelClient
from pytriton.client.exceptions import PyTritonClientInferenceServerError
from tritonclient.utils import InferenceServerException

from components.launch.processes import find_free_ports, group_members, wait_for
from components.serving.auth import new_secret, triton_headers
from components.serving.clients import CriticClient, RewardClient, ServerError
from components.serving.launcher import launch
from components.serving.servers import (CRITIC_INFER, CRITIC_SAVE, CRITIC_TRAIN, REWARD_MODEL, REWARD_TEXT,
                                        ServerSpec)
from models.config import RLHFConfig
from models.critic import CriticInputError
from models.reward import load_reward_model, load_reward_tokenizer, reward_limit, text_char_budget, text_reward_scores

REPO = Path(__file__).resolve().parents[3]
VOCAB = 40  # ids the tiny models know (their vocabularies are larger)


def config(tiny_models, tmp_path, **deploy) -> RLHFConfig:
    return RLHFConfig.model_validate({
        "model": {"policy": tiny_models["policy"], "reward": tiny_models["reward"], "critic": tiny_models["critic"]},
        "critic": {"train_batch_size": 8, "micro_batch_size": 8, "epochs": 1},
        "deploy": {"state_dir": str(tmp_path), "critic": {"max_train_rows": 64, **deploy}}})


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    """A critic server (combined reward model, reward_text) and a reward server of one run, each holding the run's
    secret as a run hands it over."""
    root = tmp_path_factory.mktemp("security")
    cfg = config(tiny_models, root)
    secret = new_secret()
    critic_port = find_free_ports()
    reward_port = find_free_ports()
    while abs(reward_port - critic_port) < 3:
        reward_port = find_free_ports()
    started = {
        "critic": launch(ServerSpec(kind="critic", config=cfg, port=critic_port, torch_threads=1,
                                    checkpoint_dir=str(root / "critic")), root / "critic.log", wait=False, secret=secret),
        "reward": launch(ServerSpec(kind="reward", config=cfg, port=reward_port, torch_threads=1), root / "reward.log",
                         wait=False, secret=secret)}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.wait_until_ready(180), started.values()))
        yield {**started, "secret": secret, "cfg": cfg}
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.stop(), started.values()))


def address(server) -> str:
    return server.url.split("://")[1]


def tensor(name: str, array: np.ndarray, datatype: str | None = None) -> http.InferInput:
    datatype = datatype or {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
                            np.dtype(np.float64): "FP64", np.dtype(np.bool_): "BOOL", np.dtype(object): "BYTES"}[array.dtype]
    item = http.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


def batch(seed: int = 0, rows: int = 4, width: int = 8):
    rng = np.random.default_rng(seed)
    return rng.integers(4, VOCAB, (rows, width)).astype(np.int64), np.full((rows, 1), width, np.int64)


def own_request_served(servers) -> None:
    """The run's own client is served, with finite values and rewards."""
    tokens, lengths = batch(7)
    with CriticClient(servers["critic"].url, secret=servers["secret"]) as critic:
        values, rewards = critic.infer(tokens, lengths)
    assert torch.isfinite(values).all() and rewards is not None and torch.isfinite(rewards).all()
    with RewardClient(servers["reward"].url, secret=servers["secret"], text=True) as reward:
        assert torch.isfinite(reward.score_text(["a prompt"], ["a response"])).all()


# ------------------------------------------------------------------------------------------------ strangers
def test_a_stranger_is_refused_on_every_api_but_liveness_and_readiness(servers):
    tokens, lengths = batch()
    train = [tensor("tokens", tokens), *(tensor(n, np.zeros(tokens.shape, np.float32) + (n == "mask"))
                                         for n in ("returns", "prev_values", "mask"))]
    calls = {
        "critic_infer": lambda c, h: c.infer(CRITIC_INFER, [tensor("tokens", tokens), tensor("sequence_lengths", lengths)],
                                             headers=h),
        "critic_train": lambda c, h: c.infer(CRITIC_TRAIN, train, headers=h),
        "critic_save": lambda c, h: c.infer(CRITIC_SAVE, [tensor("dummy_var", np.zeros(1, np.int64))], headers=h),
        "model config": lambda c, h: c.get_model_config(CRITIC_INFER, headers=h),
        "model metadata": lambda c, h: c.get_model_metadata(CRITIC_TRAIN, headers=h),
        "server metadata": lambda c, h: c.get_server_metadata(headers=h),
        "repository index": lambda c, h: c.get_model_repository_index(headers=h),
        "statistics": lambda c, h: c.get_inference_statistics(headers=h),
        "unload a model": lambda c, h: c.unload_model(CRITIC_TRAIN, headers=h),
    }
    client = http.InferenceServerClient(address(servers["critic"]))
    try:
        before = client.get_inference_statistics(CRITIC_TRAIN, headers=triton_headers(servers["secret"]))
        for who, headers in (("no token", {}), ("another run's token", triton_headers(new_secret())),
                             ("the run's secret itself", {"triton-access-token": servers["secret"]})):
            for what, call in calls.items():
                with pytest.raises(InferenceServerException) as err:
                    call(client, headers)
                assert err.value.status() == "403" and "restricted" in err.value.message(), (who, what)
        # liveness and readiness stay open (a probe needs no secret)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(CRITIC_TRAIN)
        after = client.get_inference_statistics(CRITIC_TRAIN, headers=triton_headers(servers["secret"]))
        assert after == before  # no stranger's critic_train ever reached the critic
    finally:
        client.close()
    # NeMo-Aligner's client (pytriton's ModelClient) sends no credentials: refused by a server not in open mode
    with pytest.raises(Exception, match="403|restricted"):
        with ModelClient(servers["critic"].url, CRITIC_INFER, init_timeout_s=10) as nemo:
            nemo.infer_batch(tokens=tokens, sequence_lengths=lengths)
    own_request_served(servers)


def test_a_server_started_without_the_runs_secret_refuses_to_start(tiny_models, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RLHF_RUN_SECRET", "RLHF_RUN_SECRET_FILE")}
    proc = subprocess.run([sys.executable, "-m", "components.cli.main", "serve", "reward", "--model",
                           tiny_models["reward"], "--port", str(find_free_ports())], cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "deploy.reward.auth=secret" in proc.stderr and "RLHF_RUN_SECRET" in proc.stderr
    assert "deploy.reward.auth=none" in proc.stderr  # and how to serve a client without credentials


# ------------------------------------------------------------------------------------------------ bounded requests
def test_an_oversized_body_is_refused_and_the_server_keeps_serving(servers):
    host, port = address(servers["critic"]).split(":")
    size = 70 << 20  # over Triton's 64 MB
    header = (f"POST /v2/models/{CRITIC_INFER}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"triton-access-token: {triton_headers(servers['secret'])['triton-access-token']}\r\n"
              f"Content-Length: {size}\r\n\r\n").encode()
    answer = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(header)
        chunk = b" " * (1 << 20)
        try:
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole body arrived
        try:
            answer = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            pass
    status = answer.split(b"\r\n", 1)[0]
    assert not status.startswith(b"HTTP/1.1 2"), status  # never processed
    own_request_served(servers)


def test_returns_of_3e38_are_refused_and_the_critic_stays_finite(servers):
    """The issue's probe: one critic_train with returns of 3e38 used to make every later value NaN."""
    tokens, lengths = batch(3)
    mask = np.ones(tokens.shape, np.float32)
    raw = http.InferenceServerClient(address(servers["critic"]))
    try:
        with pytest.raises(InferenceServerException, match=r"CriticInputError: returns: \|values\| must be at most 1e\+06, got 3e\+38"):
            raw.infer(CRITIC_TRAIN, [tensor("tokens", tokens), tensor("returns", mask * 3e38),
                                     tensor("prev_values", mask * 0), tensor("mask", mask)],
                      headers=triton_headers(servers["secret"]))
    finally:
        raw.close()
    with CriticClient(servers["critic"].url, secret=servers["secret"]) as critic:
        stats = critic.train(tokens, mask * 0.5, mask * 0, mask)  # a good request trains, nothing skipped
        assert stats["skipped_steps"] == 0 and np.isfinite(stats["loss_mean"])
        values, _ = critic.infer(tokens, lengths)
    assert torch.isfinite(values).all()


def test_a_critic_train_over_max_train_rows_is_refused_naming_tokens(servers):
    tokens, _ = batch(4, rows=65, width=4)
    mask = np.ones(tokens.shape, np.float32)
    with CriticClient(servers["critic"].url, secret=servers["secret"]) as critic:
        with pytest.raises(ServerError, match=r"tokens: batch of 65 rows exceeds this server's max_train_rows=64"):
            critic.train(tokens, mask, mask * 0, mask)
    own_request_served(servers)


def test_a_huge_reward_text_is_cut_before_tokenizing_and_scored_as_its_tail(servers, tiny_models):
    """5 MB of response text: the server keeps the characters the reward model can score, tokenizes them outside
    the critic's lock, and scores the pair as the same pair cut to those characters."""
    tokenizer = load_reward_tokenizer(tiny_models["reward"])
    model = load_reward_model(tiny_models["reward"])
    budget = text_char_budget(tokenizer, reward_limit(model))
    huge = "the cat is very good . " * (5_000_000 // 23)
    assert len(huge) > 100 * budget
    with RewardClient(servers["critic"].url, secret=servers["secret"], text=True) as client:
        served = client.score_text(["review :"], [huge])
    local = text_reward_scores(model, tokenizer, ["review :"], [huge[-budget:]])
    torch.testing.assert_close(served, local, rtol=1e-5, atol=1e-5)
    own_request_served(servers)


# ------------------------------------------------------------------------------------------------ fuzzing
DATATYPES = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP64": np.float64, "BOOL": np.bool_}
ENDPOINTS = {  # server, model, its declared inputs
    CRITIC_INFER: ("critic", ["tokens", "sequence_lengths", "sentences", "add_EOS"]),
    CRITIC_TRAIN: ("critic", ["tokens", "returns", "prev_values", "mask"]),
    CRITIC_SAVE: ("critic", ["dummy_var"]),
    REWARD_TEXT: ("critic", ["prompts", "responses", "columns"]),
    REWARD_MODEL: ("reward", ["tokens", "sequence_lengths", "prompt_lengths", "columns"]),
}
EXAMPLES = {CRITIC_INFER: 120, CRITIC_TRAIN: 80, CRITIC_SAVE: 25, REWARD_TEXT: 80, REWARD_MODEL: 100}
FUZZED: Counter = Counter()


@st.composite
def malformed(draw, declared: list[str]):
    """A request of named tensors, mostly wrong: inputs missing, unknown or repeated names, any dtype, rank 0-3 with
    dimensions 0-5 (a valid-looking batch now and then), values from valid ids to NaN, Inf, 3e38 and negative."""
    names = draw(st.lists(st.sampled_from(declared + ["bogus"]), max_size=len(declared) + 1, unique=True))
    inputs = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        if draw(st.booleans()):
            texts = draw(st.lists(st.one_of(st.binary(max_size=12), st.text(max_size=12).map(str.encode)),
                                  min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
            inputs[name] = ("BYTES", np.array(texts, dtype=object).reshape(shape))
            continue
        datatype = draw(st.sampled_from(sorted(DATATYPES)))
        dtype = DATATYPES[datatype]
        if datatype == "BOOL":
            elements = st.booleans()
        elif datatype.startswith("INT"):
            elements = st.one_of(st.integers(0, VOCAB), st.integers(-(2 ** 31), 2 ** 31 - 1))
        else:
            elements = st.one_of(st.floats(-2, 2, width=32), st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -1e30]))
        inputs[name] = (datatype, draw(arrays(dtype, shape, elements=elements)))
    return inputs


def fuzz(servers, model: str) -> None:
    server, declared = ENDPOINTS[model]
    client = http.InferenceServerClient(address(servers[server]), network_timeout=120)
    headers = triton_headers(servers["secret"])

    @settings(max_examples=EXAMPLES[model], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(malformed(declared))
    def one(inputs):
        FUZZED[model, "sent"] += 1
        try:
            client.infer(model, [tensor(name, array, datatype) for name, (datatype, array) in inputs.items()],
                         headers=headers)
            FUZZED[model, "served"] += 1
        except InferenceServerException as exc:
            message = exc.message() or str(exc)
            assert exc.status() in ("400", None, "500") or "400" in str(exc), message
            assert any(f"'{n}'" in message or f"{n}:" in message or f"[{n}]" in message or f"'{n}," in message
                       for n in declared + list(inputs) + [model]), message  # the refusal names a tensor (or model)
            FUZZED[model, "refused"] += 1
        except ValueError as exc:  # tritonclient refused to build the request itself (e.g. a rank-0 BYTES tensor)
            FUZZED[model, "not sendable"] += 1
            assert str(exc)

    try:
        one()
    finally:
        client.close()
    assert FUZZED[model, "refused"] > EXAMPLES[model] // 2


@pytest.mark.parametrize("model", list(ENDPOINTS))
def test_malformed_tensors_are_refused_naming_the_tensor_and_the_server_keeps_serving(servers, model):
    fuzz(servers, model)
    own_request_served(servers)
    assert servers["critic"].poll() is None and servers["reward"].poll() is None
    print(f"fuzz {model}: {dict((k[1], v) for k, v in FUZZED.items() if k[0] == model)}")


# ------------------------------------------------------------------------------------------------ runs that die
PARENT = """
import sys
from components.serving.launcher import launch
from components.serving.servers import ServerSpec
from models.config import RLHFConfig
spec = ServerSpec.model_validate_json(sys.argv[1])
server = launch(spec, sys.argv[2])
print(server.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_server_whose_run_is_killed_stops_and_leaves_nothing(tiny_models, tmp_path):
    cfg = config(tiny_models, tmp_path)
    spec = ServerSpec(kind="reward", config=cfg, port=find_free_ports(), torch_threads=1)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, spec.model_dump_json(), str(tmp_path / "reward.log")],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        server = int(parent.stdout.readline())
        assert group_members(server)  # serving: the server and its tritonserver
        os.kill(parent.pid, signal.SIGKILL)  # the run dies without a chance to stop it
        parent.wait()
        started = time.monotonic()
        assert wait_for(lambda: not group_members(server), 60, poll_s=0.2), [p.name() for p in group_members(server)]
        assert time.monotonic() - started < 60
        log = (tmp_path / "reward.log").read_text()
        assert "stop requested" in log or "stopped" in log
    finally:
        parent.kill()
        parent.wait()
