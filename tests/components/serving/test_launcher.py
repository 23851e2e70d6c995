"""Launching, readiness diagnostics and stopping of server child processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest

from components.cli.main import build_parser
from components.cli.serve import spec_from_args
from components.launch.processes import ServerNotReady, find_free_ports, port_block_free, wait_until_ready
from components.serving.launcher import child_env, server_argv, triton_probe, triton_server
from components.serving.triton.contract import CRITIC_MODELS, REWARD_MODELS, ServerSpec
from components.serving.triton.serve import prepare_environment


def serve_argv(*args: str) -> list[str]:
    """`rlhf serve ...` as a user types it."""
    return [sys.executable, "-m", "components.cli.main", "serve", *args]


def test_child_env_isolates_pytriton_home_and_the_server_puts_this_libpython_first(tmp_path, monkeypatch):
    env = child_env(tmp_path / "home", "the-runs-secret-value", {"EXTRA": "1"})
    assert env["PYTRITON_HOME"] == env["RLHF_OWN_DIR"] == str(tmp_path / "home")  # its own, to remove if orphaned
    assert env["RLHF_RUN_SECRET"] == "the-runs-secret-value" and env["EXTRA"] == "1"
    assert env["RLHF_PARENT_PID"] == str(os.getpid())  # the server ends with this process
    assert str(Path(__file__).resolve().parents[3]) in env["PYTHONPATH"].split(":")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/somewhere/else")
    prepare_environment()  # what every server process does before Triton starts (the one place that sets it)
    assert os.environ["LD_LIBRARY_PATH"].split(":") == [sysconfig.get_config_var("LIBDIR"), "/somewhere/else"]


def test_ports_are_explicit_blocks_away_from_the_defaults():
    port = find_free_ports()
    assert not ({port, port + 1, port + 2} & {5000, 8000, 8001, 8002})
    assert port_block_free("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 2))
        s.listen()
        assert not port_block_free("127.0.0.1", port)


def test_the_child_gets_its_whole_spec_as_one_json_document(tiny_models, tmp_path):
    from models.config import preset

    cfg = preset("tiny", **{"model.reward": tiny_models["reward"], "critic.combine_reward": False,
                            "critic.optim.lr": 0.002, "reward.source": "function",
                            "reward.function": "models.tasks.sentiment:gold_reward",
                            "model.policy": tiny_models["policy"]})
    spec = ServerSpec(kind="critic", config=cfg, port=23456, checkpoint_dir=str(tmp_path / "c"))
    argv = server_argv(spec)
    assert argv[:4] == [sys.executable, "-m", "components.serving.triton.main", "--spec"] and len(argv) == 5
    assert ServerSpec.model_validate_json(argv[4]) == spec
    assert spec.models == CRITIC_MODELS  # no reward_text: the reward model is not combined
    assert spec.config.critic.optim.lr == 0.002


def test_rlhf_serve_flags_map_onto_the_config_tree(tiny_models, tmp_path):
    args = build_parser().parse_args(["serve", "critic", "--reward", tiny_models["reward"], "--no-combine", "--port",
                                      "23456", "--checkpoint-dir", str(tmp_path / "c"), "--set",
                                      "critic.optim.lr=0.002"])
    spec = spec_from_args(args)
    assert spec.kind == "critic" and spec.port == 23456 and spec.checkpoint_dir == str(tmp_path / "c")
    assert spec.config.model.reward == tiny_models["reward"] and spec.config.critic.combine_reward is False
    assert spec.config.critic.optim.lr == 0.002
    assert set(spec.config.sources.models) == {"model.reward"} == set(spec.loaded_models)  # no critic: from the RM
    assert spec.config.sources.data == {}  # a server started on its own pins what it loads, no data set
    args = build_parser().parse_args(["serve", "reward", "--function", "models.tasks.sentiment:gold_reward",
                                      "--tokenizer", tiny_models["policy"]])
    spec = spec_from_args(args)
    assert spec.port == 8500 and spec.config.reward.source == "function"
    assert spec.config.reward.function == "models.tasks.sentiment:gold_reward"
    assert spec.config.model.policy == tiny_models["policy"]
    assert set(spec.config.sources.models) == {"model.policy"}
    assert spec.config.local_path("model.policy") == tiny_models["policy"]


def test_wrong_port_says_nothing_is_listening():
    port = find_free_ports()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ServerNotReady) as err:
        wait_until_ready(triton_probe(url, CRITIC_MODELS), 1.5, "critic server", url)
    assert err.value.reason == "not_listening"
    assert f"nothing listening at 127.0.0.1:{port}" in str(err.value) and "timed out after" in str(err.value)


def test_a_listener_that_never_answers_is_a_plain_timeout():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(ServerNotReady) as err:
            wait_until_ready(triton_probe(url, REWARD_MODELS), 1.0, "reward server", url)
    assert err.value.reason == "timeout"
    assert f"server at 127.0.0.1:{port} accepted the connection but did not answer" in str(err.value)


def test_a_server_that_closes_the_connection_while_answering_is_unhealthy_not_an_error():
    """A server going away (one that lost a rank) may read a probe's request and close the connection without an
    answer: the probe says so (a run's failure then waits for the server's exit and names it) instead of raising."""
    with socket.socket() as closing:
        closing.bind(("127.0.0.1", 0))
        closing.listen()
        port = closing.getsockname()[1]

        closing.settimeout(0.2)
        done = threading.Event()

        def accept_read_close():  # every connection: the client may retry on a new one
            while not done.is_set():
                try:
                    conn, _ = closing.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.recv(4096)

        thread = threading.Thread(target=accept_read_close, daemon=True)
        thread.start()
        health = triton_probe(f"http://127.0.0.1:{port}", REWARD_MODELS)()
        done.set()
        thread.join(10)
    assert not health.ok and health.reason == "not_listening"
    assert health.status.startswith(f"server at 127.0.0.1:{port} closed the connection while answering"), health.status


def test_a_model_that_fails_to_load_is_reported_with_its_state_and_reason(tiny_models, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "README").write_text("no config.json here")
    port = find_free_ports()
    argv = serve_argv("critic", "--model", str(not_a_model), "--reward", tiny_models["reward"], "--port", str(port))
    with triton_server(argv, "127.0.0.1", port, CRITIC_MODELS, tmp_path / "critic.log", name="critic") as proc:
        with pytest.raises(ServerNotReady) as err:
            proc.wait_until_ready(timeout=600)
        message = str(err.value)
        assert err.value.reason == "not_ready"
        assert message.startswith(f"server up at 127.0.0.1:{port} but model critic_infer not ready (state UNAVAILABLE")
        assert str(not_a_model) in message  # the reason travels through the server's repository summary
        assert "timed out" not in message  # a failed load is reported as such, not by waiting out the timeout
        assert proc.poll() is None  # the server keeps answering with the reason
    assert proc.poll() is not None and not proc.group_members()


def test_a_server_that_dies_at_start_reports_its_exit_code_and_log(tiny_models, tmp_path):
    port = find_free_ports()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))  # its port is taken
    blocker.listen()
    try:
        argv = serve_argv("reward", "--model", tiny_models["reward"], "--port", str(port))
        with triton_server(argv, "127.0.0.1", port, REWARD_MODELS, tmp_path / "reward.log", name="reward") as proc:
            with pytest.raises(ServerNotReady) as err:
                proc.wait_until_ready(timeout=120)
        assert err.value.reason == "process_exited"
        assert "reward server exited with code 1 before" in str(err.value)
        assert f"port {port} on 127.0.0.1 already in use" in str(err.value)  # the log tail says why
    finally:
        blocker.close()


def test_stop_after_a_crash_leaves_no_process_and_frees_the_ports(tiny_models, tmp_path):
    """The server process dies hard (SIGKILL): its tritonserver and stub are orphans that stop() must still remove.

    (The graceful path, SIGTERM -> exit code 0 -> same port reusable, is covered by the restart test of test_servers.)
    """
    port = find_free_ports()
    argv = serve_argv("reward", "--model", tiny_models["reward"], "--port", str(port))
    with triton_server(argv, "127.0.0.1", port, REWARD_MODELS, tmp_path / "reward.log", name="reward") as proc:
        proc.wait_until_ready(timeout=120)
        members = proc.group_members()
        names = " ".join(" ".join(p.cmdline()) for p in members)
        assert "tritonserver" in names and "triton_python_backend_stub" in names
        home = Path(psutil.Process(proc.pid).environ()["PYTRITON_HOME"])
        assert home.is_dir() and any(home.iterdir())  # this server's own PyTriton workspace
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ServerNotReady) as err:
            proc.wait_until_ready(timeout=10)
        assert err.value.reason == "process_exited" and "exited with code -9" in str(err.value)
        assert proc.group_members()  # tritonserver and the stub outlived it
        code = proc.stop()
    assert code == -9
    assert not proc.group_members()
    for member in members:
        assert not member.is_running() or member.status() == psutil.STATUS_ZOMBIE
    assert not home.exists() and not list(Path("/dev/shm").glob(f"pytrtion{proc.pid}-*"))
    assert port_block_free("127.0.0.1", port)
    assert proc.stop() == -9  # idempotent
    assert "stopped with code -9" in proc.log_path.read_text()


def test_child_process_group_is_its_own(tiny_models, tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with triton_server(argv, "127.0.0.1", find_free_ports(), [], tmp_path / "sleep.log", name="sleep") as proc:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        with pytest.raises(ServerNotReady) as err:
            wait_until_ready(triton_probe(proc.url, ["x"]), 0.5, "sleep server", proc.url, process=proc)
        assert err.value.reason == "not_listening"
        assert proc.death(settle_s=0.5) == f"sleep server (pid {proc.pid}, {proc.url}) is not healthy: " + \
            triton_probe(proc.url, ["x"])().status  # alive, but nothing listens: named, not taken for serving
    assert proc.poll() == -15  # SIGTERM ended it within the grace period
