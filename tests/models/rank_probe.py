"""The processes of tests/models/test_rendezvous.py: ranks of a run's group over loopback, and strangers to it.

    python rank_probe.py member RANK PORT OUT [pickle]   a rank of the run (its secret in $RLHF_RUN_SECRET) in a group
    of
                                                         2 whose rank 0 listens at 127.0.0.1:PORT: every rank's object
                                                         gathered on rank 0, which writes what it got to OUT; `pickle`:
                                                         rank 1 then sends rank 0 a pickle where a message belongs
    python rank_probe.py stranger PORT OUT MARKER        joins 127.0.0.1:PORT as rank 1 with torch's own rendezvous
                                                         and sends rank 0 a pickle that, unpickled, creates MARKER
    python rank_probe.py forger PORT OUT                 reads the store's keys until rank 0's appears and writes its
                                                         own value under rank 1's key beside it
    python rank_probe.py prover RANK PORT OUT SECRET     a member of a gloo group of 2 formed over a plain store (as if
                                                         it had got past the run's store), proving SECRET
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import pickle
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import distributed, rendezvous


class Planted:
    """What a stranger sends: unpickling it calls pathlib.Path.touch(MARKER), i.e. runs the sender's choice of code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def write(out: str, result: dict) -> None:
    Path(out).write_text(json.dumps(result))


def member(rank: int, port: int, out: str, send_pickle: bool) -> None:
    me = distributed.Dist(rank, 2, rank, 2)
    try:
        timeout = float(os.environ.get("RANK_PROBE_TIMEOUT_S", "60"))
        distributed.init(me, "gloo", timeout, torch.device("cpu"), os.environ["RLHF_RUN_SECRET"], ("127.0.0.1", port))
        gathered = me.gather_object({"rank": rank})
        if send_pickle:  # a message in the collective's own shape (size, then bytes), holding a pickle
            if rank == 1:
                payload = torch.frombuffer(bytearray(pickle.dumps(Planted(out + ".marker"))), dtype=torch.uint8)
                dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), 1)
                dist.broadcast(payload, 1)
            else:
                me.broadcast_object(None, src=1)
        write(out, {"gathered": gathered})
    except Exception as exc:  # noqa: BLE001 - what failed is what the test reads
        write(out, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    os._exit(0)  # no interpreter teardown: gloo's threads may abort it (pytorch PR 179291)


def stranger(port: int, out: str, marker: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        dist.gather_object(Planted(marker), None, dst=0)
        received = [None]
        dist.broadcast_object_list(received, src=0)
        write(out, {"joined": True, "received": repr(received[0])})
    except Exception as exc:  # noqa: BLE001 - the stranger's failure is what the test expects
        write(out, {"joined": False, "error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)


def forger(port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        keys = [k for k in store.list_keys() if k.endswith("/0")]  # rank 0's gloo address, under the group's prefix
        if keys:
            forged = keys[0][:-1] + "1"
            store.set(forged, b"a stranger's address" * 8)
            write(out, {"forged": forged, "keys": store.list_keys()})
            break
        time.sleep(0.01)
    else:
        write(out, {"forged": None, "keys": store.list_keys()})
    os._exit(0)


def prover(rank: int, port: int, out: str, secret: str) -> None:
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    try:
        rendezvous.prove(group, rank, 2, secret, torch.device("cpu"), "probe")
        write(out, {"proven": True})
    except rendezvous.RendezvousRefused as exc:
        write(out, {"proven": False, "error": str(exc)})
    os._exit(0)


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "member":
        member(int(args[0]), int(args[1]), args[2], args[3:] == ["pickle"])
    elif role == "stranger":
        stranger(int(args[0]), args[1], args[2])
    elif role == "forger":
        forger(int(args[0]), args[1])
    else:
        prover(int(args[0]), int(args[1]), args[2], args[3])
