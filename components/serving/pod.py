"""`python -m components.serving.pod KIND --config-json JSON [...]`: what a server pod of a run runs (launch=kubernetes;
components/cluster/objects.leader_worker_set).

It starts the `KIND` server exactly as a local run starts its own (components/serving/local.local_server: the
same launcher, ports, probes and checks), holding the run's secret from the Secret mounted into the pod
($RLHF_RUN_SECRET_FILE), copies the server's log to its own output (`kubectl logs` shows it), and lives as long as
the server: a server that exits ends the pod with its exit code (the run sees the pod end and fails naming it); a
SIGTERM (the pod deleted: the run stopped it, or its owner went away) stops the server first. The critic saves into
the pod's state directory and uploads every save to the run's store (--checkpoint-uri).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from components.serving.auth import read_secret
from components.serving.local import local_server
from components.serving.started import section
from models.config import RLHFConfig


def follow(path: Path, stop: threading.Event, out=sys.stdout) -> None:
    """Copy what is written to `path` to `out` until `stop` is set (and what is left after)."""
    while not path.exists() and not stop.wait(0.2):
        pass
    if not path.exists():
        return
    with open(path, "r", errors="replace") as log:
        while True:
            line = log.readline()
            if line:
                out.write(line)
                out.flush()
            elif stop.wait(0.2):
                out.write(log.read())
                out.flush()
                return


def serve(kind: str, cfg: RLHFConfig, checkpoint_uri=None, restore_iteration=None, trainer_host=None) -> int:
    """Run the server until it exits (its code) or this process is told to stop (0)."""
    secret = read_secret()
    if not secret:
        raise SystemExit(f"{kind} server: no run secret ($RLHF_RUN_SECRET_FILE names the Secret mounted into the pod)")
    server_dir = cfg.resolved_state_dir() / "servers" / kind
    server_dir.mkdir(parents=True, exist_ok=True)
    log_path = server_dir / f"{kind}-server.log"
    fields = {}
    if kind == "critic":
        fields = {"checkpoint_dir": str(server_dir / "critic"), "checkpoint_uri": checkpoint_uri,
                  "restore_iteration": restore_iteration}
    stop = threading.Event()
    copier = threading.Thread(target=follow, args=(log_path, stop), daemon=True, name="server-log")
    copier.start()

    def terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    try:
        with local_server(kind, cfg, log_path, secret, trainer_host, **fields) as server:
            print(f"{kind} server: pid {server.pid}, {server.url}; "
                  f"readiness: {section(kind, cfg).ready_timeout_s:.0f}s", flush=True)
            while (code := server.poll()) is None:
                time.sleep(1.0)
            print(f"{kind} server exited with code {code}", flush=True)
            return code or 1  # a server never ends by itself while its run needs it
    finally:
        stop.set()
        copier.join(timeout=5)
        shutil.rmtree(server_dir / "critic", ignore_errors=True)  # every save is in the run's store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.serving.pod", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("critic", "reward", "rollout"))
    parser.add_argument("--config-json", required=True, help="the run's config (RLHFConfig JSON), bound to the pod")
    parser.add_argument("--checkpoint-uri", help="critic: the run's store, where every save is uploaded")
    parser.add_argument("--restore-iteration", type=int, help="critic: start from iter_<N>/critic of that store")
    parser.add_argument("--trainer-host", help="rollout: the one address a weight-transfer group may be set up with")
    args = parser.parse_args(argv)
    cfg = RLHFConfig.model_validate_json(args.config_json)
    return serve(args.kind, cfg, args.checkpoint_uri, args.restore_iteration, args.trainer_host)


if __name__ == "__main__":
    sys.exit(main())
