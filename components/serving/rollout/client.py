"""The rollout server's client (rank 0 of the actor): HTTP for requests, and the weight transfer, over HTTP or over a
torch.distributed group. It is the `RolloutServer` that models/engines/vllm.py samples from.

The server proves it holds the run's secret on every new connection before anything is sent on it, and every request
is signed with the run's key (components/handshake.py: the secret never crosses the wire; the server refuses
anyone else); requests carry the run's token (`run`): the server serves the run that first sent it weights and refuses
any other (409, naming both). Weights go as the server's next version; the server answers with the version it applied.

Weight transfer (`rollout.vllm.weight_transfer`), one tensor at a time in the actor's Hugging Face names, the tied
lm_head included:
- `http`: one POST /update_weights whose body is a safetensors file written as the tensors are gathered (the header
  comes first, from the tensors' names, dtypes and shapes known in advance), so the trainer holds one tensor at a
  time; the server reads the body into one buffer.
- `dist`: a torch.distributed group of this process (rank 0, the TCPStore's master, listening on the one address
  the server reaches us at, never every interface) and the server's workers (ranks 1..), joined once (POST
  /weights/init) by the run's processes only: the store's keys and values are signed with the run's secret and every
  member proves it before the first tensor (components/serving/rollout/group.py); per update, POST /weights/update
  names the tensors, and once the server holds its lock and receives (it sets a key in our store) each tensor is
  broadcast and loaded by vLLM as it arrives; then POST /weights/digests sends each tensor's sha256 on the
  authenticated HTTP channel, and the server refuses the update (its version unmoved) if a tensor it received
  differs. gloo on CPU; NCCL when the tensors are on a GPU (not run here: no GPU was lent). The same shape as vLLM's
  weight-transfer API (the server runs it with a backend of ours) and TRL's `vllm_client` (init_communicator, then
  per-parameter broadcasts).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import httpx
import torch

from components.serving.auth import read_secret
from components.serving.rollout.group import join, tensor_digest
from components.handshake import run_client
from models.engines.base import Weights
from models.engines.vllm import EngineRequestError
from models.rendezvous import RendezvousRefused, open_store

CHUNK = 4 << 20  # bytes per piece of a streamed HTTP body
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class RolloutClient:
    """HTTP client of the rollout server for one run (`run`: its token; `secret`: the run's secret, None:
    $RLHF_RUN_SECRET); `transport` moves the weights."""

    def __init__(self, url: str, run: str, timeout_s: float = 600.0, secret: str | None = None):
        self.url, self.run = url.rstrip("/"), run
        self.secret = secret if secret is not None else read_secret()
        self.http = run_client(self.secret, "rollout", base_url=self.url, timeout=timeout_s)
        self.timeout_s = timeout_s
        self.transport: HTTPWeights | DistWeights = HTTPWeights(self)

    def health(self) -> dict:
        """/health's answer (a broken server answers 503: an error naming why)."""
        return self.check(self.http.get("/health"))

    def version(self) -> int:
        return int(self.health()["weights_version"])

    def generate(self, request: dict) -> dict:
        return self.check(self.http.post("/generate", json={**request, "run": self.run}))

    def load_weights(self, weights: Weights, version: int) -> dict:
        """The full weights as update `version`, over this client's transport; the answer gains the seconds it took
        here and the bytes sent."""
        started = time.perf_counter()
        answer = self.transport.send(weights, version)
        return {**answer, "total_s": time.perf_counter() - started, "bytes": weight_bytes(weights),
                "transport": self.transport.name}

    def use_dist(self, host: str, timeout_s: float | None = None) -> None:
        """Move weights over a torch.distributed group with the server's workers (one per tensor-parallel shard, as
        its /health says) from now on; its TCPStore at `host`, the address the server reaches this process at."""
        workers = int(self.health().get("tensor_parallel_size", 1))
        self.transport = DistWeights(self, host, timeout_s or self.timeout_s, workers)

    def check(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise EngineRequestError(f"rollout server {self.url}{response.request.url.path} answered "
                                     f"{response.status_code}: {detail}")
        return response.json()

    def close(self) -> None:
        self.transport.close()
        self.http.close()


def weight_bytes(weights: Weights) -> int:
    return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
               for _, dtype, shape in weights.specs)


def safetensors_header(weights: Weights) -> bytes:
    """The header of a safetensors file holding `weights` (names, dtypes, shapes, offsets), padded to 8 bytes."""
    entries, offset = {}, 0
    for name, dtype, shape in weights.specs:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"weights: {name} has dtype {dtype}; the transfer sends "
                             f"{sorted(map(str, SAFETENSORS_DTYPES))}")
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def safetensors_stream(weights: Weights) -> Iterator[bytes]:
    """A safetensors file of `weights` as pieces of at most CHUNK bytes, each tensor read as it comes (a tied tensor
    is written again under each of its names)."""
    yield safetensors_header(weights)
    for (name, dtype, shape), tensor in zip(weights.specs, weights.tensors):
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weights: {name} came as {tensor.dtype} {tuple(tensor.shape)}, announced as {dtype} "
                             f"{tuple(shape)}")
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
        for start in range(0, len(data), CHUNK):
            yield data[start:start + CHUNK].tobytes()


class HTTPWeights:
    """Weights as the body of one POST /update_weights (a server this process cannot join in a group)."""

    name = "http"

    def __init__(self, client: RolloutClient):
        self.client = client

    def send(self, weights: Weights, version: int) -> dict:
        length = len(safetensors_header(weights)) + weight_bytes(weights)
        return self.client.check(self.client.http.post(
            "/update_weights", params={"version": version, "run": self.client.run}, content=safetensors_stream(weights),
            headers={"content-type": "application/octet-stream", "content-length": str(length)}))

    def close(self) -> None:
        pass


class DistWeights:
    """Weights broadcast over a torch.distributed group of this process (rank 0) and the rollout server's `workers`
    (ranks 1.., one per tensor-parallel shard: each loads its shard of every tensor). The group admits the run's
    processes only (its store on `host` alone, keys and values signed, every member's proof of the run's secret:
    components/serving/rollout/group.py); each update's digests follow its tensors on the HTTP channel."""

    name = "dist"

    def __init__(self, client: RolloutClient, host: str, timeout_s: float, workers: int = 1):
        self.client, self.workers = client, workers
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        if not client.secret:
            raise EngineRequestError("weight transfer over dist: no run secret ($RLHF_RUN_SECRET) to admit the "
                                     "rollout server's workers with")
        store, port = open_store(host, 0, 1 + workers, True, client.secret, self.timeout)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="weights")
        # our side of the group waits for the server's: in a thread of its own, so that a refused /weights/init
        # (another run's server) fails here at once instead of after the timeout
        joined: dict = {}

        def join_group() -> None:
            try:
                joined["group"], _ = join(self.backend, host, port, 0, 1 + workers, client.secret, self.device,
                                          self.timeout, store=store)
            except Exception as exc:  # noqa: BLE001 - said below, or by the server's refusal
                joined["error"] = exc

        waiter = threading.Thread(target=join_group, daemon=True, name="weights-group")
        waiter.start()
        try:
            client.check(client.http.post("/weights/init", json={
                "run": client.run, "master_address": host, "master_port": port, "backend": self.backend,
                "timeout_s": timeout_s, "world_size": 1 + workers}))
        except EngineRequestError:
            waiter.join(1.0)  # a member that failed its proof is named on both sides: ours says which rank
            if isinstance(joined.get("error"), RendezvousRefused):
                raise EngineRequestError(f"rollout server {client.url}: weight-transfer group refused: "
                                         f"{joined['error']}") from None
            raise
        waiter.join(timeout_s)
        if "group" not in joined:
            raise EngineRequestError(f"rollout server {client.url} joined the weight-transfer group, but this side "
                                     f"did not within {timeout_s:.0f}s ({joined.get('error', 'no answer')})")
        self.group, self.store, self.port = joined["group"], store, port

    def _post(self, path: str, **kwargs) -> Future:
        return self.pool.submit(lambda: self.client.check(self.client.http.post(path, **kwargs)))

    def send(self, weights: Weights, version: int) -> dict:
        """The update's tensors over the group, their sha256 digests after them on POST /weights/digests: the server
        checks every tensor it received against them before the version moves (a mismatch: the update refused)."""
        key = f"ready-{version}-{secrets.token_hex(4)}"
        answer = self._post("/weights/update", params={"ready_key": key}, json={
            "run": self.client.run, "version": version, "names": [name for name, _, _ in weights.specs],
            "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in weights.specs],
            "shapes": [list(shape) for _, _, shape in weights.specs]})
        # broadcast only once every worker of the server receives: a refused update answers first, and nothing is
        # sent; a key is believed once its value is signed (the store's `get`)
        keys = [f"{key}-{rank}" for rank in range(1, 1 + self.workers)]
        while not self.store.check(keys):
            if answer.done():
                answer.result()  # raises the server's refusal
                raise EngineRequestError("rollout server answered the weight update before receiving it")
            time.sleep(0.002)
        for ready in keys:
            self.store.get(ready)
        digests = []
        for (name, dtype, shape), tensor in zip(weights.specs, weights.tensors):
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"weights: {name} came as {tensor.dtype} {tuple(tensor.shape)}, announced as "
                                 f"{dtype} {tuple(shape)}")
            data = tensor.detach().to(self.device).contiguous()
            digests.append(tensor_digest(data))
            self.group.broadcast(data, 0).wait()
        try:
            self.client.check(self.client.http.post("/weights/digests", json={
                "run": self.client.run, "version": version, "ready_key": key, "digests": digests}))
        except EngineRequestError:
            if answer.done():
                answer.result()  # the update's own failure says more
            raise
        return answer.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.group = self.store = None


def run_token(run_name: str) -> str:
    """A token naming one trainer process of a run: the run name, the process and a random part (a retried flow's
    old actor, still alive, has another one)."""
    return f"{run_name}/{os.getpid()}-{secrets.token_hex(3)}"


