"""The `dist` weight channel between the trainer and the vLLM rollout server admits the run's processes only, and
refuses tensors that changed on the way (components/serving/rollout/group.py, client.py, app.py): a real rollout
server in .venv-vllm on the tiny policy, a real gloo group over 127.0.0.1, and a stranger on the same machine."""

from __future__ import annotations

import datetime
import json
import threading

import httpx
import pytest
import torch
import torch.distributed as dist

from components.launch.processes import wait_for
from components.serving.auth import request_headers
from components.serving.launcher import launch_rollout, rollout_python
from components.serving.rollout.client import HTTPWeights, RolloutClient
from models.config import from_layers
from models.engines.vllm import EngineRequestError
from models.policy import Policy
from models.resolve import pin
from models.tasks import sentiment

pytestmark = pytest.mark.slow(2)

RUN = "test-rollout-weight-channel/1"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    cfg = pin(from_layers({"model": {"policy": tiny_models["policy"]}, "rollout": {"engine": "vllm"},
                           "deploy": {"state_dir": str(tmp_path_factory.mktemp("rollout")),
                                      "rollout": {"port": 0, "threads": 1}}}))
    rollout_python(cfg)  # a missing .venv-vllm fails here, naming `make vllm-venv`
    with launch_rollout(cfg, tmp_path_factory.mktemp("logs") / "rollout-server.log") as proc:
        proc.wait_until_ready(300)
        yield proc


@pytest.fixture(scope="module")
def policy(tiny_models):
    return Policy.load(tiny_models["policy"])


class Stranger:
    """A process's worth of stranger: once it learns the port of the trainer's store (as a port scan would), it joins
    it first, as rank 1 of a gloo group of 2 (what the rollout server does, minus the run's secret), and waits for
    rank 0's tensors."""

    def __init__(self, timeout_s: float = 20.0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.joined, self.received, self.error = threading.Event(), [], None
        self.connected = threading.Event()

    def join(self, port: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=self.timeout)
            self.connected.set()
            group = dist.ProcessGroupGloo(store, 1, 2, self.timeout)
            self.joined.set()
            while True:
                tensor = torch.empty(1 << 20, dtype=torch.uint8)
                group.broadcast(tensor, 0).wait()
                self.received.append(tensor)
        except Exception as exc:  # noqa: BLE001 - what it met is what the test reads
            self.error = exc
        finally:
            self.connected.set()

    def first(self, request: httpx.Request) -> None:
        """An httpx request hook: before POST /weights/init names the port to the server, the stranger joins it (its
        rank-1 key is in the store once the hook returns)."""
        if request.url.path != "/weights/init":
            return
        port = json.loads(request.content)["master_port"]
        threading.Thread(target=self.join, args=(port,), daemon=True).start()
        assert self.connected.wait(30)
        probe = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=self.timeout)
        assert wait_for(lambda: any(k.endswith("/1") for k in probe.list_keys()), 30), probe.list_keys()


def test_a_stranger_who_joins_the_weight_group_first_receives_nothing_and_the_server_still_joins(server, policy):
    """The stranger is in the trainer's store as rank 1 before the server is asked to join: the server joins, the
    run's weights reach it (the next version, sampled from), and the stranger forms no group and receives no tensor
    (its own rendezvous times out)."""
    stranger = Stranger()
    client = RolloutClient(server.url, RUN, timeout_s=60, secret=server.secret)
    client.http.event_hooks["request"].append(stranger.first)
    try:
        client.use_dist("127.0.0.1", timeout_s=60)
        version = client.version()
        answer = client.load_weights(policy.engine_weights(), version + 1)
        assert answer["weights_version"] == version + 1 and answer["transport"] == "dist"
        assert client.generate({"prompt_token_ids": policy.encode_prompts(sentiment.prompts(1)), "max_new_tokens": 2,
                                "expected_version": version + 1})["samples"]
        assert wait_for(lambda: stranger.error is not None, 60), "the stranger is still waiting"
        assert not stranger.joined.is_set() and stranger.received == [], stranger.error
    finally:
        client.close()


class Tampering:
    """The trainer's side of the group, with one tensor's bytes changed on the way (after the trainer digested it):
    what a peer between the trainer and the server could do to the stream."""

    def __init__(self, group, at: int):
        self.group, self.at, self.calls = group, at, 0

    def broadcast(self, tensor: torch.Tensor, root: int):
        self.calls += 1
        if self.calls == self.at:
            tensor = tensor.clone()
            tensor.view(-1)[0] += 1
        return self.group.broadcast(tensor, root)


def test_a_tensor_changed_on_the_way_is_refused_by_its_digest_and_the_version_stays(server, policy):
    """The third tensor of an update differs from what the trainer sent: the server refuses the update naming the
    tensor (400), its version does not move, it serves nothing until a full update, which mends it."""
    client = RolloutClient(server.url, RUN, timeout_s=60, secret=server.secret)
    try:
        client.use_dist("127.0.0.1", timeout_s=60)
        version = client.version()
        weights = policy.engine_weights()
        third = weights.specs[2][0]
        client.transport.group = Tampering(client.transport.group, at=3)
        with pytest.raises(EngineRequestError, match=rf"400: weights: update to version {version + 1} failed: "
                                                     rf"digests: tensor {third} arrived with sha256"):
            client.load_weights(weights, version + 1)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["weights_version"] == version
        assert "digests" in health.json()["broken"]
        client.transport.close()
        client.transport = HTTPWeights(client)
        assert client.load_weights(policy.engine_weights(), version + 1)["weights_version"] == version + 1
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        client.close()


def test_digests_for_no_update_in_progress_are_refused_naming_the_key(server):
    response = httpx.post(f"{server.url}/weights/digests",
                          headers=request_headers(server.secret, "POST", "/weights/digests"),
                          json={"run": RUN, "version": 1, "ready_key": "none", "digests": []}, timeout=30)
    assert response.status_code == 409 and response.json()["detail"].startswith("ready_key: no weight update waits")
