"""Child processes in their own group: start with a log, exit code, liveness, stop (SIGTERM, then SIGKILL) until no
member of the group is left; the poll helper."""

from __future__ import annotations

import os
import re
import signal
import sys

import psutil
import pytest

from components.launch.processes import (ChildProcess, Health, ServerNotReady, alive, group_members, stop_group,
                                         wait_for, wait_until_ready)

# a leader that starts a grandchild ignoring SIGTERM in its group, prints its pid, then sleeps
STUBBORN = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('grandchild', 'up', flush=True); time.sleep(60)"], stdout=sys.stdout)
print("grandchild", child.pid, flush=True)
time.sleep(60)
"""


def test_wait_for_returns_the_first_truthy_answer_or_the_last_falsy_one():
    answers = iter([0, None, "yes"])
    assert wait_for(lambda: next(answers), timeout=5, poll_s=0.01) == "yes"
    asked = []
    assert wait_for(lambda: asked.append(1) or [], timeout=0.2, poll_s=0.05) == []  # time ran out: the last answer
    assert len(asked) >= 2  # it kept asking until then

    def fatal():
        raise RuntimeError("gone")

    with pytest.raises(RuntimeError, match="gone"):
        wait_for(fatal, timeout=5)


def test_stop_kills_what_ignores_sigterm_and_leaves_no_member_of_the_group(tmp_path):
    proc = ChildProcess([sys.executable, "-c", STUBBORN], tmp_path / "logs" / "stubborn.log")
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a session of its own
    try:
        assert wait_for(lambda: "grandchild up" in proc.tail(), timeout=30)
        grandchild = int(next(line.split()[1] for line in proc.tail().splitlines()
                              if line.startswith("grandchild") and line.split()[1].isdigit()))
        assert {p.pid for p in proc.group_members()} == {proc.pid, grandchild}
    finally:
        code = proc.stop(grace_s=1.0)
    assert code == -signal.SIGTERM  # the leader obeys SIGTERM; its child needs SIGKILL
    assert proc.group_members() == [] and not alive(grandchild)
    assert proc.stop() == -signal.SIGTERM  # idempotent
    log = proc.log_path.read_text()
    assert log.startswith("--- ") and "starting:" in log and log.count(f"--- stopped with code {-signal.SIGTERM}") == 1


def test_a_group_is_stopped_by_pid_alone_as_rlhf_down_does(tmp_path):
    """`rlhf up` leaves the Popen behind; a later `rlhf down` knows only the pid from the pid file."""
    pid = ChildProcess([sys.executable, "-c", STUBBORN], tmp_path / "stubborn.log").pid
    try:
        assert wait_for(lambda: len(group_members(pid)) == 2, timeout=30)
        assert alive(pid)
    finally:
        stop_group(pid, grace_s=1.0)
    assert group_members(pid) == [] and not alive(pid)
    with pytest.raises(psutil.NoSuchProcess):  # reaped: no zombie of ours left behind
        psutil.Process(pid).status()


def test_a_process_sharing_our_group_is_stopped_alone(tmp_path):
    proc = ChildProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "sleep.log", own_group=False)
    try:
        assert os.getpgid(proc.pid) == os.getpgid(0)
        assert [p.pid for p in proc.group_members()] == [proc.pid]
    finally:
        code = proc.stop(grace_s=5.0)
    assert code == -signal.SIGTERM
    assert proc.group_members() == []


def test_a_readiness_wait_says_what_it_waits_for_and_how_long_it_has_waited():
    """A cold GPU node takes minutes to serve: every report_every_s of waiting (30 s in a run) the run's log is told
    what is awaited, where, what was seen and how long of how long it has waited; the timeout names the last sight."""
    said = []

    def never():
        return Health(False, "nothing listening at 127.0.0.1:9 (refused)", "not_listening")

    with pytest.raises(ServerNotReady, match=r"timed out after 1s waiting for rollout server replica 1 at "
                                             r"http://127\.0\.0\.1:9: nothing listening") as err:
        wait_until_ready(never, 1.0, "rollout server replica 1", "http://127.0.0.1:9", poll_s=0.05, report=said.append,
                         report_every_s=0.3)
    assert err.value.reason == "not_listening"
    assert said and all(re.fullmatch(r"waiting for the rollout server replica 1 at http://127\.0\.0\.1:9: nothing "
                                     r"listening at 127\.0\.0\.1:9 \(refused\) \(\d+ s of 1 s\)", m)
                                     for m in said), said
