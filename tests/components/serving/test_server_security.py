"""The critic and reward servers serve their own run only, and no request can hurt them (issue 32's probes, against real
PyTriton servers started as a run starts them):
- a stranger (unsigned, signed with another run's key, or sending the run's secret itself) is refused on every API but
  liveness/readiness; NeMo-Aligner's client too unless the server runs in open mode
  (tests/components/serving/test_nemo_aligner_contract.py);
- Triton's own access token is nowhere (its command line holds none, /proc/<pid>/cmdline is world-readable), Triton
  listens on no TCP port, and its admin APIs (model loading above all: a python-backend model is code run as the
  run) are closed to every caller, the run included;
- an oversized body is refused by Triton; critic_train with returns of 3e38 is refused naming `returns`, and the
  critic's values stay finite; a critic_train over max_train_rows is refused naming `tokens`; a 5 MB reward_text is
  scored from the characters the model can see, as the same text's tail is;
- Hypothesis builds malformed tensors for every endpoint (wrong dtypes, ranks, shapes, missing and unknown inputs,
  NaN/Inf/huge values, bad UTF-8): each is refused with an error naming a tensor, and the run's own requests are
  served afterwards;
- a server whose run is SIGKILLed stops, and leaves nothing behind: no process, not its directory (its workspace,
  with the repository Triton loaded its models from)."""

from __future__ import annotations

import os
import signal
import stat
import socket
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch
import tritonclient.http as http
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from pytriton.client import ModelClient
from tritonclient.utils import InferenceServerException

from components.launch.processes import find_free_ports, group_members, wait_for
from components import handshake
from components.serving.auth import new_secret, request_headers
from components.serving.launcher import launch
from components.serving.triton.clients import CriticClient, RewardClient, ServerError
from components.serving.triton.contract import (CRITIC_INFER, CRITIC_SAVE, CRITIC_TRAIN, REWARD_MODEL, REWARD_TEXT,
                                                ServerSpec)
from models.config import RLHFConfig, from_layers
from models.resolve import pin
from models.reward import load_reward_model, load_reward_tokenizer, reward_limit, text_char_budget, text_reward_scores

REPO = Path(__file__).resolve().parents[3]
VOCAB = 40  # ids the tiny models know (their vocabularies are larger)


def config(tiny_models, tmp_path, **deploy) -> RLHFConfig:
    """A run's config as its servers receive it: what it reads pinned (models/resolve.py)."""
    return pin(from_layers({
        "preset": "tiny",
        "model": {"policy": tiny_models["policy"], "reward": tiny_models["reward"], "critic": tiny_models["critic"]},
        "critic": {"train_batch_size": 8, "micro_batch_size": 8, "epochs": 1},
        "deploy": {"state_dir": str(tmp_path), "critic": {"max_train_rows": 64, **deploy}}}))


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
                                    checkpoint_dir=str(root / "critic")), root / "critic.log", wait=False,
                                    secret=secret),
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
                            np.dtype(np.float64): "FP64", np.dtype(np.bool_): "BOOL",
                            np.dtype(object): "BYTES"}[array.dtype]
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
def infer_path(model: str) -> str:
    return f"/v2/models/{model}/infer"


def test_a_stranger_is_refused_on_every_api_but_liveness_and_readiness(servers):
    tokens, lengths = batch()
    train = [tensor("tokens", tokens), *(tensor(n, np.zeros(tokens.shape, np.float32) + (n == "mask"))
                                         for n in ("returns", "prev_values", "mask"))]
    calls = {  # what the run may call: (method, path, the call with headers h)
        "critic_infer": ("POST", infer_path(CRITIC_INFER), lambda c, h: c.infer(
            CRITIC_INFER, [tensor("tokens", tokens), tensor("sequence_lengths", lengths)], headers=h)),
        "critic_train": ("POST", infer_path(CRITIC_TRAIN), lambda c, h: c.infer(CRITIC_TRAIN, train, headers=h)),
        "critic_save": ("POST", infer_path(CRITIC_SAVE), lambda c, h: c.infer(
            CRITIC_SAVE, [tensor("dummy_var", np.zeros(1, np.int64))], headers=h)),
        "model config": ("GET", f"/v2/models/{CRITIC_INFER}/config",
                         lambda c, h: c.get_model_config(CRITIC_INFER, headers=h)),
        "model metadata": ("GET", f"/v2/models/{CRITIC_TRAIN}", lambda c,
                           h: c.get_model_metadata(CRITIC_TRAIN, headers=h)),
        "server metadata": ("GET", "/v2", lambda c, h: c.get_server_metadata(headers=h)),
        "statistics": ("GET", "/v2/models/stats", lambda c, h: c.get_inference_statistics(headers=h)),
    }
    token = new_secret()
    strangers = {  # who: (headers for method, path; the status the server answers)
        "no credentials": (lambda m, p: {}, "401"),
        "another run's key": (lambda m, p: request_headers(token, m, p), "403"),
        "the run's secret itself": (lambda m, p: {"authorization": f"Bearer {servers['secret']}"}, "401"),
        "the Triton token the run used to send": (lambda m, p: {"triton-access-token": servers["secret"]}, "401"),
    }
    client = http.InferenceServerClient(address(servers["critic"]))
    stats = f"/v2/models/{CRITIC_TRAIN}/stats"
    try:
        before = client.get_inference_statistics(CRITIC_TRAIN, headers=request_headers(servers["secret"], "GET", stats))
        for who, (headers, status) in strangers.items():
            for what, (method, path, call) in calls.items():
                with pytest.raises(InferenceServerException) as err:
                    call(client, headers(method, path))
                assert err.value.status() == status and err.value.message().startswith("authorization:"), (who, what)
        # liveness and readiness stay open (a probe needs no secret)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(CRITIC_TRAIN)
        after = client.get_inference_statistics(CRITIC_TRAIN, headers=request_headers(servers["secret"], "GET", stats))
        assert after == before  # no stranger's critic_train ever reached the critic
        for what, (method, path, call) in calls.items():  # the run, signing each request, is served
            call(client, request_headers(servers["secret"], method, path))
    finally:
        client.close()
    # NeMo-Aligner's client (pytriton's ModelClient) sends no credentials: refused by a server not in open mode
    with pytest.raises(Exception, match="401|authorization"):
        with ModelClient(servers["critic"].url, CRITIC_INFER, init_timeout_s=10) as nemo:
            nemo.infer_batch(tokens=tokens, sequence_lengths=lengths)
    own_request_served(servers)


PYTHON_MODEL = """
import os
class TritonPythonModel:
    def initialize(self, args):
        open(os.environ["RLHF_PWNED"], "w").write("ran as the run")
"""


def test_the_admin_apis_are_closed_to_everyone_the_run_included(servers, tmp_path):
    """The issue's probe: with Triton's token (on its command line, readable by any local user) a stranger could load
    a python-backend model through the repository API, i.e. run code as the run. Every admin API is refused now,
    whoever asks: unsigned, with the old token, and signed with the run's own key."""
    import base64
    import json

    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "x", "data_type": "TYPE_INT64", "dims": [1]}],
                         "output": [{"name": "y", "data_type": "TYPE_INT64", "dims": [1]}]})
    load = {"parameters": {"config": config, "file:1/model.py": base64.b64encode(PYTHON_MODEL.encode()).decode()}}
    admin = [("POST", "/v2/repository/models/evil/load", load),
             ("POST", f"/v2/repository/models/{CRITIC_TRAIN}/unload", {}),
             ("POST", "/v2/repository/index", {}), ("GET", "/v2/trace/setting", None),
             ("POST", "/v2/trace/setting", {"trace_file": str(tmp_path / "trace")}), ("GET", "/v2/logging", None),
             ("POST", "/v2/logging", {"log_file": str(tmp_path / "log")}),
             ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/x", "offset": 0, "byte_size": 8}),
             ("GET", "/v2/systemsharedmemory/status", None), ("GET", "/v2/cudasharedmemory/status", None)]
    for server in (servers["critic"], servers["reward"]):
        for method, path, body in admin:
            for headers in ({}, {"triton-access-token": servers["secret"]},
                            request_headers(servers["secret"], method, path)):
                answer = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
                assert answer.status_code == 403 and "closed to every caller" in answer.json()["error"], \
                    (path, headers.keys(), answer.text)
        models = httpx.get(f"{server.url}/rlhf/models",
                           headers=request_headers(servers["secret"], "GET", "/rlhf/models"),
                           timeout=30)
        assert models.status_code == 200 and "evil" not in {m["name"] for m in models.json()}
        assert httpx.get(f"{server.url}/rlhf/models", timeout=30).status_code == 401  # the run's only
    assert not list(tmp_path.iterdir())
    own_request_served(servers)


def tritonserver(server) -> psutil.Process:
    found = [p for p in psutil.Process(server.pid).children(recursive=True) if p.name() == "tritonserver"]
    assert len(found) == 1, found
    return found[0]


def test_tritonserver_has_no_token_on_its_command_line_and_no_port_of_its_own(servers):
    """Any local user reads /proc/<pid>/cmdline: Triton's holds no token (and no secret of the run), and Triton
    listens on no TCP port; it listens on a Unix socket in the server's workspace, a directory only the run's user
    may enter. The server's address (its front) is the only way in."""
    keys = [servers["secret"], *(k.hex() for k in (handshake.RunKeys(servers["secret"]).client,
                                                  handshake.RunKeys(servers["secret"]).server))]
    for server in (servers["critic"], servers["reward"]):
        triton = tritonserver(server)
        cmdline = open(f"/proc/{triton.pid}/cmdline", "rb").read().decode().split("\0")
        assert not any(word in arg for arg in cmdline
                       for word in ("restricted", "access-token", "token", *keys)), cmdline
        assert not [c for c in triton.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        socket_path = cmdline[cmdline.index("--http-address") + 1].removeprefix("unix:")
        assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
        listening = {c.laddr.port for c in psutil.Process(server.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {int(server.url.rsplit(":", 1)[1])}  # the front, nothing else
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
    authorization = request_headers(servers["secret"], "POST", infer_path(CRITIC_INFER))["authorization"]
    header = (f"POST /v2/models/{CRITIC_INFER}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"authorization: {authorization}\r\nContent-Length: {size}\r\n\r\n").encode()
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
        with pytest.raises(InferenceServerException,
                           match=r"CriticInputError: returns: \|values\| must be at most 1e\+06, got 3e\+38"):
            raw.infer(CRITIC_TRAIN, [tensor("tokens", tokens), tensor("returns", mask * 3e38),
                                     tensor("prev_values", mask * 0), tensor("mask", mask)],
                      headers=request_headers(servers["secret"], "POST", infer_path(CRITIC_TRAIN)))
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
# each endpoint's inputs as the contract declares them: (Triton datatype, shape as 'B'/'L'/1 entries, required)
CONTRACT = {
    CRITIC_INFER: ("critic", {"tokens": ("INT64", "BL", True), "sequence_lengths": ("INT64", "B1", True),
                              "sentences": ("BYTES", "B1", False), "add_EOS": ("BOOL", "B1", False)}),
    CRITIC_TRAIN: ("critic", {"tokens": ("INT64", "BL", True), "returns": ("FP32", "BL", True),
                              "prev_values": ("FP32", "BL", True), "mask": ("FP32", "BL", True)}),
    CRITIC_SAVE: ("critic", {"dummy_var": ("INT64", "1", True)}),
    REWARD_TEXT: ("critic", {"prompts": ("BYTES", "B1", True), "responses": ("BYTES", "B1", True),
                             "columns": ("BYTES", "B1", False)}),
    REWARD_MODEL: ("reward", {"tokens": ("INT64", "BL", True), "sequence_lengths": ("INT64", "B1", True),
                              "prompt_lengths": ("INT64", "B1", False), "columns": ("BYTES", "B1", False)}),
}
EXAMPLES = {CRITIC_INFER: 150, CRITIC_TRAIN: 100, CRITIC_SAVE: 25, REWARD_TEXT: 100, REWARD_MODEL: 150}
FUZZED: Counter = Counter()
UNNAMED: list = []

INTS = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, 300), st.integers(-(2 ** 63), 2 ** 63 - 1))
SPECIAL = [np.nan, np.inf, -np.inf, float(np.float32(3e38)), float(np.float32(-1e30)), float(np.float32(2e6))]
TEXTS = st.one_of(st.text(max_size=16).map(str.encode), st.binary(max_size=8),  # invalid UTF-8 among them
                  st.sampled_from([b'{"label": 1}', b"[1, 2]", b"not json", b"{", b"\xff\xfe", b""]))


def values(datatype: str, shape: tuple, draw, name: str = ""):
    if datatype == "BYTES":
        n = int(np.prod(shape))
        return np.array(draw(st.lists(TEXTS, min_size=n, max_size=n)), dtype=object).reshape(shape)
    if datatype == "BOOL":
        elements = st.booleans()
    elif datatype.startswith("INT"):
        elements = INTS if datatype == "INT64" else st.integers(-(2 ** 31), 2 ** 31 - 1)
    else:
        width = 32 if datatype == "FP32" else 64
        common = st.sampled_from([0.0, 1.0]) if name == "mask" else st.floats(-3, 3, width=width)
        elements = st.one_of(common, st.floats(-3, 3, width=width), st.sampled_from(SPECIAL))
    return draw(arrays(DATATYPES[datatype], shape, elements=elements))


@st.composite
def malformed(draw, contract: dict):
    """A request built from the endpoint's contract, then broken: most keep the declared inputs, dtypes and shapes
    and break their values (ids outside the vocabulary, lengths outside [1, L], NaN/Inf/3e38, masks not 0/1,
    invalid UTF-8, columns that are not JSON objects), others break one tensor's dtype or shape, drop a required
    input or add an unknown one; a valid request comes out now and then (it is served)."""
    B, L = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    dims = {"B": B, "L": L, "1": 1}
    inputs = {}
    for name, (datatype, layout, required) in contract.items():
        if required or draw(st.booleans()):
            shape = tuple(dims[c] for c in layout)
            inputs[name] = (datatype, values(datatype, shape, draw, name))
    how = draw(st.sampled_from(["values", "values", "values", "dtype", "shape", "missing", "unknown"]))
    target = draw(st.sampled_from(sorted(contract)))
    if how == "dtype":
        datatype = draw(st.sampled_from(sorted(DATATYPES) + ["BYTES"]))
        shape = inputs[target][1].shape if target in inputs else (B, 1)
        inputs[target] = (datatype, values(datatype, shape, draw, target))
    elif how == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        inputs[target] = (contract[target][0], values(contract[target][0], shape, draw, target))
    elif how == "missing":
        inputs.pop(target, None)
    elif how == "unknown":
        inputs["bogus"] = ("FP32", values("FP32", (max(B, 1), 1), draw))
    return inputs


def fuzz(servers, model: str) -> None:
    server, contract = CONTRACT[model]
    declared = list(contract)
    client = http.InferenceServerClient(address(servers[server]), network_timeout=120)

    @settings(max_examples=EXAMPLES[model], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(malformed(contract))
    def one(inputs):
        FUZZED[model, "sent"] += 1
        try:
            client.infer(model, [tensor(name, array, datatype) for name, (datatype, array) in inputs.items()],
                         headers=request_headers(servers["secret"], "POST", infer_path(model)))
            FUZZED[model, "served"] += 1
        except InferenceServerException as exc:
            message = exc.message() or str(exc)
            # Triton's own checks answer 400; an error our callables raise comes back as 500 (PyTriton reports every
            # callable error as a model execution error), its message naming the tensor
            assert exc.status() in ("400", "500"), message
            if inputs and not any(f"'{n}'" in message or f"{n}:" in message or f"[{n}]" in message
                                  or f"'{n}," in message
                       for n in declared + list(inputs)):
                UNNAMED.append((model, message.splitlines()[0][:300] if message else repr(exc),
                                {n: (d, a.shape, a.ravel()[:3].tolist()) for n, (d, a) in inputs.items()}))
            FUZZED[model, "refused"] += 1
            FUZZED[model, f"status {exc.status()}"] += 1
        except ValueError as exc:  # tritonclient refused to build the request itself (e.g. a rank-0 BYTES tensor)
            FUZZED[model, "not sendable"] += 1
            assert str(exc)

    try:
        one()
    finally:
        client.close()
    counts = {k[1]: v for k, v in FUZZED.items() if k[0] == model}
    assert counts["sent"] == EXAMPLES[model] and counts.get("refused", 0) >= EXAMPLES[model] // 4, counts
    assert not UNNAMED, UNNAMED[:5]  # every refusal named a tensor


@pytest.mark.parametrize("model", list(CONTRACT))
def test_malformed_tensors_are_refused_naming_the_tensor_and_the_server_keeps_serving(servers, model):
    fuzz(servers, model)
    own_request_served(servers)
    assert servers["critic"].poll() is None and servers["reward"].poll() is None
    print(f"fuzz {model}: {dict((k[1], v) for k, v in FUZZED.items() if k[0] == model)}")


# ------------------------------------------------------------------------------------------------ runs that die
PARENT = """
import sys
from components.serving.launcher import launch
from components.serving.triton.contract import ServerSpec
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
        home = Path(psutil.Process(server).environ()["RLHF_OWN_DIR"])  # the directory the run made for it alone
        # Triton loaded each model from the repository in the server's workspace (no copy of its own in /tmp)
        assert sorted(path.parent.name for path in home.glob("workspace_*/model-store/*/config.pbtxt")) == \
            sorted(spec.models)
        os.kill(parent.pid, signal.SIGKILL)  # the run dies without a chance to stop it
        parent.wait()
        assert wait_for(lambda: not group_members(server), 60, poll_s=0.2), [p.name() for p in group_members(server)]
        log = (tmp_path / "reward.log").read_text()
        assert "stop requested" in log or "stopped" in log
        assert wait_for(lambda: not home.exists(), 30, poll_s=0.2), list(home.rglob("*"))  # its workspace, temp files
    finally:
        parent.kill()
        parent.wait()
