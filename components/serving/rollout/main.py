"""The vLLM rollout server: vLLM's own engine behind a small FastAPI app (uvicorn), run in its own environment.

The entry point (components/serving/launcher.py starts it; on a cluster its own pod): the process's environment for
vLLM (set before vllm is imported), its cores, the run's secret, the parent it must not outlive, the port, then the app
(components/serving/rollout/app.py). Runs in .venv-vllm: imports nothing from the project (components/serving/rollout/
__init__.py).

Start: python -m components.serving.rollout.main --model DIR --port P [--dtype ... --max-model-len ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Optional

# in-process engine (tensors reach the model directly) and quiet start-up; set before vllm is imported
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch
import uvicorn

from components.serving.connections import IDLE_S, MAX_CONNECTIONS, allow_open_files, bounded_protocol
from components.serving.rollout.app import ServedModel, build_app
from components.serving.rollout.group import SECRET_ENV, SECRET_FILE_ENV, read_secret

log = logging.getLogger("rlhf.rollout_server")

PARENT_PID_ENV = "RLHF_PARENT_PID"  # as components/launch/processes.py: the run process this server must not outlive


def run_secret() -> str:
    """The run's secret from $RLHF_RUN_SECRET or the file $RLHF_RUN_SECRET_FILE names (group.read_secret); a server
    without one does not start: it would serve anyone."""
    value = read_secret() or ""
    if len(value) < 16:
        log.error(f"no run secret (at least 16 characters) in ${SECRET_ENV} or ${SECRET_FILE_ENV}: a rollout server "
                  f"serves one run, and takes requests carrying that run's secret only")
        raise SystemExit(2)
    return value


def exit_with_parent(poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """Stop within `poll_s` once the run process that started us ($RLHF_PARENT_PID) is gone (as components/launch/
    processes.exit_with_parent): SIGTERM to our process group (uvicorn shuts down), SIGKILL after `grace_s`."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0") or 0)
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error(f"the run process {parent} that started this server is gone: stopping")
        group = os.getpgid(0)
        target = ((lambda sig: os.killpg(group, sig)) if group == os.getpid()
                  else (lambda sig: os.kill(os.getpid(), sig)))
        target(signal.SIGTERM)
        time.sleep(grace_s)
        target(signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def pin_to_cores(spec: str) -> set[int]:
    """Bind every thread of this process to the cores of `spec` (a Linux core list: "1", "2-3", "0,4-5"), as a pod's
    CPU set would: vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND) reaches only the thread that built the engine, while
    generation runs in the web server's worker threads."""
    try:
        cores = {core for part in spec.split(",") for core in
                 (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    except ValueError:
        raise SystemExit(f"--cpu-cores: {spec!r} is not a core list like 1, 2-3 or 0,4-5") from None
    try:
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), cores)
    except OSError as exc:
        raise SystemExit(f"--cpu-cores: cannot run on cores {sorted(cores)} ({exc.strerror}); this process may use "
                         f"{sorted(os.sched_getaffinity(0))}") from None
    return cores


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (config, tokenizer, weights).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None, help="Default: the model's own limit.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is sharded over.")
    parser.add_argument("--instance", default="",
                        help="Nonce echoed by /health (the launcher checks it reached its own server).")
    parser.add_argument("--cpu-cores", default=None,
                        help="Cores every thread of this process runs on, e.g. 1 or 2-3,6.")
    parser.add_argument("--trainer-host", default="127.0.0.1",
                        help="The one address POST /weights/init may name (the trainer's).")
    parser.add_argument("--max-request-sequences", type=int, default=4096, help="Cap on prompts x n per /generate.")
    parser.add_argument("--max-request-tokens", type=int, default=1 << 23,
                        help="Cap on prompts x n x max_new_tokens per /generate.")
    parser.add_argument("--max-body-mib", type=int, default=32,
                        help="Largest JSON body; a weight upload is bounded by the model's size.")
    parser.add_argument("--body-timeout-s", type=float, default=60.0,
                        help="An upload that sends nothing for this long is dropped.")
    parser.add_argument("--max-in-flight", type=int, default=64, help="The run's requests served at once (503 beyond).")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="Open connections at most: one more closes the longest idle one.")
    parser.add_argument("--idle-s", type=float, default=IDLE_S,
                        help="A connection without a request this long is closed.")
    args = parser.parse_args(argv)
    if args.cpu_cores:  # before any worker thread starts: the threads started later inherit it
        pin_to_cores(args.cpu_cores)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = run_secret()
    exit_with_parent()
    # the port first, before the model loads: a port taken by someone else fails at once, naming it
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        log.error(f"--port: cannot bind {args.host}:{args.port}: {exc.strerror or exc}")
        raise SystemExit(2) from None
    if args.enforce_eager and not torch.cuda.is_available():
        # eager on a CPU host means nothing compiled: vLLM still torch.compiles its sampler's helpers (the sampled
        # token's rank, the random sample) with inductor, i.e. g++ on first use (~15 CPU-s for a server with an
        # empty cache, ~6 with a warm one; docs/benchmarks.md); dynamo off, they run as the plain torch they trace
        torch._dynamo.config.disable = True
    started = time.perf_counter()
    served = ServedModel(args.model, args.dtype, args.max_model_len, args.seed, args.enforce_eager,
                         args.gpu_memory_utilization, args.instance, args.trainer_host, args.max_request_sequences,
                         args.max_request_tokens, args.tensor_parallel_size)
    log.info(f"engine loaded in {time.perf_counter() - started:.1f}s: {json.dumps(served.describe())}")
    app = build_app(served, secret, args.max_body_mib << 20, args.body_timeout_s, args.max_in_flight)
    allow_open_files(args.max_connections + 256)  # the connections, and the engine's own files
    uvicorn.Server(uvicorn.Config(app, log_level="warning", http=bounded_protocol(args.max_connections, args.idle_s),
                                  timeout_keep_alive=int(args.idle_s))).run(sockets=[sock])


if __name__ == "__main__":
    main()
