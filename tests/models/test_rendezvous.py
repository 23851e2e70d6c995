"""The channel between a run's ranks admits the run's processes only, and runs no code it is sent (models/
rendezvous.py, models/wire.py, models/distributed.init): real gloo groups of processes over 127.0.0.1, and strangers
on the same machine that know the port (tests/models/rank_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from components.launch.processes import wait_for
from tests.conftest import free_port
from tests.models.dist_update import ranks_env

PROBE = str(Path(__file__).with_name("rank_probe.py"))


def start(tmp_path: Path, name: str, *args, env: dict) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, PROBE, *map(str, args)], env=env, stdout=log, stderr=log), out


def result(proc: subprocess.Popen, out: Path, timeout: float = 120) -> dict:
    proc.wait(timeout)
    return json.loads(out.read_text())


def connected_to(pid: int, port: int) -> bool:
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in psutil.Process(pid).net_connections("tcp"))


def test_a_stranger_joining_first_as_rank_1_neither_runs_code_in_rank_0_nor_takes_part(tmp_path):
    """Rank 0 listens; a stranger (torch's own rendezvous, no secret) connects first as rank 1 and sends rank 0 a
    pickle that would create a file when unpickled; then the run's rank 1 joins. The run's two ranks form their
    group and gather each other's objects, the file is never created, and the stranger times out having received
    nothing. Rank 0's store listens on 127.0.0.1 alone."""
    env, port = ranks_env(), free_port()
    marker = tmp_path / "stranger-ran-code"
    rank0, out0 = start(tmp_path, "rank0", "member", 0, port, tmp_path / "rank0.json", env=env)
    procs = [rank0]
    try:
        assert wait_for(lambda: any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                                    for c in psutil.Process(rank0.pid).net_connections("tcp")), 60)
        listening = {c.laddr.ip for c in psutil.Process(rank0.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening  # never every interface
        strange, out_s = start(tmp_path, "stranger", "stranger", port, tmp_path / "stranger.json", marker, env=env)
        procs.append(strange)
        assert wait_for(lambda: connected_to(strange.pid, port), 60)  # it reached the store before rank 1
        rank1, out1 = start(tmp_path, "rank1", "member", 1, port, tmp_path / "rank1.json", env=env)
        procs.append(rank1)
        assert result(rank0, out0) == {"gathered": [{"rank": 0}, {"rank": 1}]}, (tmp_path / "rank0.log").read_text()
        assert result(rank1, out1) == {"gathered": None}
        stranger_saw = result(strange, out_s)
        assert stranger_saw["joined"] is False and "received" not in stranger_saw, stranger_saw
        assert not marker.exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_pickle_sent_where_a_message_belongs_is_refused_naming_its_sender_and_runs_nothing(tmp_path):
    """A rank of the run itself (holding the secret) sends rank 0 a pickle in the collective's own shape: rank 0
    refuses it as a malformed message from rank 1, and what the pickle names is never called."""
    env, port = ranks_env(), free_port()
    rank0, out0 = start(tmp_path, "rank0", "member", 0, port, tmp_path / "rank0.json", "pickle", env=env)
    rank1, out1 = start(tmp_path, "rank1", "member", 1, port, tmp_path / "rank1.json", "pickle", env=env)
    try:
        seen = result(rank0, out0)
        assert seen["error"].startswith("PayloadError: a message from rank 1 is malformed"), seen
        assert not Path(str(out1) + ".marker").exists()
        result(rank1, out1)
    finally:
        for proc in (rank0, rank1):
            proc.kill()
            proc.wait()


def test_a_value_a_stranger_writes_under_the_groups_keys_is_not_believed(tmp_path):
    """A stranger who lists the store's keys (TCPStore answers anyone) finds the group's prefix and writes its own
    value under rank 1's key before rank 1 does: rank 0 does not believe it (it carries no signature made with the
    run's secret) and waits for rank 1's signed one; the group forms and works."""
    env, port = ranks_env(), free_port()
    rank0, out0 = start(tmp_path, "rank0", "member", 0, port, tmp_path / "rank0.json", env=env)
    procs = [rank0]
    try:
        forger, out_f = start(tmp_path, "forger", "forger", port, tmp_path / "forger.json", env=env)
        procs.append(forger)
        forged = result(forger, out_f, 60)
        assert forged["forged"] and forged["forged"].endswith("/1"), forged
        rank1, out1 = start(tmp_path, "rank1", "member", 1, port, tmp_path / "rank1.json", env=env)
        procs.append(rank1)
        assert result(rank0, out0) == {"gathered": [{"rank": 0}, {"rank": 1}]}, (tmp_path / "rank0.log").read_text()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_ranks_that_hold_different_secrets_never_form_a_group(tmp_path):
    """Two processes that each hold a secret, but not the same one, meet no one: rank 0 fails within its timeout
    (here 10 s) waiting for rank 1's key, rank 1 when rank 0's store goes, and nothing is exchanged between them."""
    port = free_port()
    rank0, out0 = start(tmp_path, "rank0", "member", 0, port, tmp_path / "rank0.json",
                        env={**ranks_env(), "RANK_PROBE_TIMEOUT_S": "10"})
    rank1, out1 = start(tmp_path, "rank1", "member", 1, port, tmp_path / "rank1.json",
                        env={**ranks_env(), "RANK_PROBE_TIMEOUT_S": "10"})
    try:
        for proc, out in ((rank0, out0), (rank1, out1)):
            seen = result(proc, out, 120)
            assert "gathered" not in seen and "error" in seen, seen
        assert "wait timeout" in json.loads(out0.read_text())["error"]
    finally:
        for proc in (rank0, rank1):
            proc.kill()
            proc.wait()


def test_a_member_that_cannot_prove_the_run_secret_fails_the_group_on_every_member_naming_it(tmp_path):
    """Past the store (a stranger that reached a gloo listener first would be): once the group has formed, every
    member proves the run's secret and checks the others' proofs. Rank 1 holds another secret: both refuse the group,
    rank 0 naming rank 1 (and rank 1, holding its own secret, naming rank 0); with the same secret, both pass."""
    for secrets_given, proven in ((("the-runs-secret-0123456789", "another-secret-0123456789"), False),
                                  (("the-runs-secret-0123456789", "the-runs-secret-0123456789"), True)):
        port = free_port()
        procs = [start(tmp_path, f"prover{r}", "prover", r, port, tmp_path / f"prover{r}.json", secrets_given[r],
                       env=ranks_env()) for r in (0, 1)]
        try:
            for rank, (proc, out) in enumerate(procs):
                seen = result(proc, out)
                assert seen["proven"] is proven, seen
                if not proven:
                    assert seen["error"].startswith(f"probe: rank(s) [{1 - rank}] of 2 did not prove the run's "
                                                    f"secret"), seen
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait()
