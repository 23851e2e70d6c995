"""The actor's ranks as processes: rank 0 is this process (the flow run, or `rlhf train`); the others follow it.

One node (`deploy.actor.nproc_per_node` = N > 1, no torchrun around us): rank 0 starts ranks 1..N-1 as child processes
in a process group of their own, with the standard environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), and watches them. Several nodes: the run's controller starts node groups, each a torchrun
(components/launch/nodes.py), whose rank 0 runs the run (components/runs.py) and whose other ranks follow;
`torchrun ... -m components.launch.ranks -- <command>` still makes the process torchrun makes rank 0 exec the command
and every other rank follow. Either way a follower joins the process group, receives the run's config from rank 0,
builds the same actor, and executes rank 0's commands until told to stop (models/loop.py). The ranks share no
directory: whatever rank 0 reads from a checkpoint it broadcasts (models/loop.py restore_actor).

Who may be a rank: only a process that holds the run's secret (rank 0's, handed to the followers in their environment;
on several nodes the controller's, handed to every node group). The ranks meet through rank 0's store, listening on
rank 0's address alone, and each proves the secret before the config is sent; what they send each other is JSON and
tensors, never pickles (models/distributed.py, models/rendezvous.py, models/wire.py).

Faults: collectives time out after `deploy.actor.collective_timeout_s`; rank 0 names a follower that died (rank, exit
code, log tail) or went silent; followers exit when rank 0 disappears; no process of the run outlives it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from components.environment import quiet
from components.launch.followers import BACKEND_ENV, SECRET_ENV, TIMEOUT_ENV, Followers
from components.launch.processes import exit_with_parent

quiet()  # this module is a process's entry point too: before the model libraries below read these settings

from components.storage import s3  # noqa: F401 - registers the s3:// transport: a rank loads an s3:// model itself
from models import distributed
from models.kinds import BY_JOB
from models.loop import Leader, build, execute


def config_class(job: str) -> type:
    """The config the ranks of a job are given: its kind's run config (models/kinds.py)."""
    return BY_JOB[job].run_class


@contextmanager
def actor_ranks(cfg, log_dir: Path, secret: str) -> Iterator[Leader]:
    """The actor on all its ranks, this process being rank 0; followers are stopped on exit, whatever happened.
    `cfg` is prepared (models/prepare.py: what it reads pinned, absolute state dir, schedule lengths, reward
    transport): the ranks get it as it is, and load the pinned paths it carries (they resolve nothing). Its job
    (`cfg.job`: models/loop.build): an RL run's actor, or a stage's trainee on the same ranks. `secret`: the run's,
    which every rank proves (under torchrun, the one every node group was given)."""
    name = cfg.job
    outer = distributed.from_env()  # torchrun (several nodes) made us a rank already
    followers = None
    if outer.active:
        if outer.rank != 0:
            raise RuntimeError(f"the flow run must be actor rank 0, but RANK={outer.rank}")
        if outer.world_size != cfg.deploy.actor.world_size:
            raise ValueError(f"actor: torchrun started {outer.world_size} ranks, the config asks for "
                             f"{cfg.deploy.actor.world_size} (deploy.actor.nnodes x nproc_per_node)")
        me, address = outer, None
    elif cfg.deploy.actor.world_size > 1:
        if cfg.deploy.actor.nnodes > 1:
            raise ValueError("deploy.actor.nnodes > 1: the run's node groups are started by its controller "
                             "(components/controller.py: `rlhf train` and the training flows), not here")
        followers = Followers.for_actor(cfg, log_dir, secret)
        me, address = distributed.Dist(0, cfg.deploy.actor.world_size, 0,
                                       cfg.deploy.actor.world_size), followers.address
    else:
        me, address = distributed.SINGLE, None
    leader = None
    try:
        if me.active:
            device = distributed.local_device(cfg.deploy.device, me)
            distributed.init(me, distributed.resolve_backend(cfg.deploy.actor.backend, device),
                             cfg.deploy.actor.collective_timeout_s, device, secret, address)
            me.broadcast_object((name, cfg.model_dump_json()))
        leader = Leader(cfg, build(cfg, me), followers.describe_failure if followers else lambda: None)
        yield leader
        if me.active:
            me.broadcast_object({"op": "stop"})
            distributed.shutdown(me, graceful=True)
    finally:
        if leader is not None:
            close_state(leader.state)
        if followers is not None:
            followers.stop()
        distributed.shutdown()


def close_state(state) -> None:
    """Stop what a rank's state started besides its model (an actor's environment workers)."""
    if hasattr(state, "close"):
        state.close()


# ---------------------------------------------------------------- the follower side

def follow(secret: Optional[str]) -> int:
    """Join the group (proving the run's `secret`), receive the job and its config, build what it trains, execute
    rank 0's commands until told to stop."""
    exit_with_parent()
    me = distributed.from_env()
    device = distributed.local_device("auto", me)
    backend = distributed.resolve_backend(os.environ.get(BACKEND_ENV, "auto"), device)
    distributed.init(me, backend, float(os.environ.get(TIMEOUT_ENV, "300")), device, secret)
    try:
        name, payload = me.broadcast_object(None)
        cfg = config_class(name).model_validate_json(payload)
        state = build(cfg, me)
        try:
            while (command := me.broadcast_object(None))["op"] != "stop":
                execute(state, cfg, command)
        finally:
            close_state(state)
        distributed.shutdown(me, graceful=True)
    finally:
        distributed.shutdown()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m components.launch.ranks [-- COMMAND...]`: a follower (the run's secret in $RLHF_RUN_SECRET, as
    rank 0 gives it: `Followers`); under torchrun, rank 0 execs COMMAND instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv and int(os.environ.get("RANK", "0")) == 0:
        os.execvp(argv[0], argv)  # rank 0 becomes the flow run (it keeps torchrun's environment)
    return follow(os.environ.get(SECRET_ENV))


if __name__ == "__main__":
    sys.exit(main())
