"""How the vLLM engine shares a batch and a refit among its replicas (models/engines/vllm.py), without a server:
the prompts each replica gets, and one pass over the actor's weights handed to every replica at once."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from models.engines.base import Weights
from models.engines.vllm import EngineRequestError, replica_shares, to_every_replica

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


def test_each_replica_gets_a_contiguous_equal_share_of_whole_prompts():
    for count in (1, 2, 5, 8, 13):
        for replicas in (1, 2, 3, 4):
            shares = replica_shares(count, replicas)
            assert len(shares) == replicas
            assert [i for s in shares for i in range(count)[s]] == list(range(count))  # every prompt once, in order
            sizes = [s.stop - s.start for s in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # empty ones last
    assert replica_shares(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]


def weights_of(count: int, passes: list) -> Weights:
    """`count` tensors whose one pass is recorded in `passes` (a second pass would show)."""
    def tensors():
        passes.append([])
        for i in range(count):
            passes[-1].append(i)
            yield torch.full((3,), float(i))
    return Weights([(f"w{i}", torch.float32, (3,)) for i in range(count)], tensors())


def test_every_replica_receives_every_tensor_in_order_from_one_pass():
    passes, received = [], {}

    def send(index: int, delay: float):
        def consume(weights: Weights) -> dict:
            got = []
            for name, tensor in weights:
                time.sleep(delay)  # a slower replica: the others are not held back by more than the queue
                got.append((name, float(tensor[0])))
            received[index] = got
            return {"weights_version": 7, "replica": index}
        return consume

    with ThreadPoolExecutor(4) as pool:
        answers = to_every_replica(weights_of(20, passes), [send(0, 0.0), send(1, 0.01), send(2, 0.0)], pool, str)
    assert [a["replica"] for a in answers] == [0, 1, 2]
    assert passes == [list(range(20))]  # gathered once (on rank 0 a collective: once, in step with the others)
    assert all(received[i] == [(f"w{k}", float(k)) for k in range(20)] for i in range(3))


def test_a_replica_that_fails_mid_refit_is_named_and_holds_no_one_back():
    passes, received = [], []

    def healthy(weights: Weights) -> dict:
        received.extend(name for name, _ in weights)
        return {"weights_version": 2}

    def dying(weights: Weights) -> dict:
        for i, _ in enumerate(weights):
            if i == 3:
                raise ConnectionError("connection reset by peer")
        return {"weights_version": 2}

    with ThreadPoolExecutor(4) as pool, pytest.raises(EngineRequestError) as err:
        to_every_replica(weights_of(50, passes), [healthy, dying], pool, lambda i: f"rollout server replica {i} (url)")
    assert str(err.value) == ("rollout server replica 1 (url): the weight update failed: ConnectionError: connection "
                              "reset by peer")
    assert passes == [list(range(50))]  # the pass ran to its end (the other ranks gather in step)
    assert received == [f"w{i}" for i in range(50)]  # the healthy replica got every tensor
