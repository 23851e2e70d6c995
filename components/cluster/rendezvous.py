"""`python -m components.cluster.rendezvous --wait-for HOST [--timeout-s S] -- COMMAND...`: wait until HOST resolves,
then exec COMMAND.

What every pod of the actor's JobSet runs before torchrun (components/cluster/objects.node_args). Rank 0's address is
a pod's DNS name in the JobSet's headless Service; its record appears only once that pod exists and the cluster's
DNS has seen it, and a pod that starts first fails its first lookup (the early-DNS trap: pytorch#73682). Waiting here
keeps torchrun's own rendezvous timeout for the rendezvous itself. A name that never resolves fails the pod after
the timeout, naming it: the JobSet's failure policy takes it from there.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except OSError:
        return False


def wait_for_name(host: str, timeout_s: float, poll_s: float = 1.0, say=print) -> bool:
    """Whether `host` resolved within `timeout_s`; says every 30 s that it still waits."""
    started = time.monotonic()
    said = started
    while not resolves(host):
        now = time.monotonic()
        if now - started >= timeout_s:
            return False
        if now - said >= 30:
            say(f"rendezvous: waiting for {host} to resolve ({now - started:.0f}s)", flush=True)
            said = now
        time.sleep(poll_s)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.cluster.rendezvous", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wait-for", required=True, metavar="HOST", help="a name that must resolve first")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="fail after this long (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: what to exec then")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if not wait_for_name(args.wait_for, args.timeout_s):
        print(f"rendezvous: {args.wait_for} did not resolve within {args.timeout_s:.0f}s: the pod of node group 0 "
              f"does not exist or the JobSet's headless Service has no record of it", file=sys.stderr, flush=True)
        return 3
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
