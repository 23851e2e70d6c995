"""PPO iteration with the critic behind PyTriton (HTTP) vs in process.

The same PPO step (`models.step.train_step`) on the tiny models, once with `models.backends.LocalCritic` (critic +
combined reward model on a thread of this process) and once with `components.serving.triton.clients.CriticClient`
talking to a critic server that `components.serving.launcher.launch` starts as a child process (own process group,
stopped at the end; torch threads as the flows choose them: 1 on a CPU-only host unless `critic.torch_threads` says
otherwise). Each side has its own actor, seeded alike, and the same prompt sequence. The two sides alternate every
iteration (ABBA), so they see the same background load; one warm-up iteration per side is discarded.
Target: HTTP <= 1.10x in-process seconds per iteration (median of the per-pair ratios).

`--auth` (issue 32) measures what the run's secret costs a critic round trip: two critic servers of the same build
side by side, one in open mode (deploy.critic.auth=none, its client sends no credentials: what every server did
before the secret) and one checking a signature on every request (its front, components/serving/triton/front.py;
its client proves the server once per connection and signs each request: components/handshake.py),
critic_infer round trips alternating between them (ABBA), for a 1x8-token and a 32x64-token batch; warm-up discarded.
Written to benchmarks/results/critic_http_auth.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from benchmarks.common import RESULTS, log, quick_flag, stats, tiny_config, write_result
from components.launch.processes import find_free_ports
from components.serving.auth import new_secret
from components.serving.launcher import launch
from components.serving.triton.clients import CriticClient, critic_backend
from components.serving.triton.contract import ServerSpec
from models.algorithms import Backends
from models.backends import LocalCritic
from models.config import RLHFConfig, merge
from models.loop import build_actor, build_critic_trainer, load_prompts, prompt_batches
from models.resolve import pin
from models.step import train_step

TARGET = 1.10
PHASES = ("generate", "logprobs", "reference", "critic_wait", "train", "critic_train_wait")


def bench_config():
    return tiny_config(algorithm="ppo")


def server_threads(cfg) -> int | None:
    """The flows' default for a local critic server (CriticConfig.torch_threads): as configured, else 1 on a
    CPU-only host (it shares the cores with the actor), else torch's default."""
    return cfg.deploy.critic.torch_threads or (None if torch.cuda.is_available() else 1)


@contextmanager
def http_critic(cfg):
    """A critic server child process for `cfg` on free ports, and a CriticClient to it; both closed on exit."""
    started = time.perf_counter()
    port = find_free_ports(cfg.deploy.critic.host)
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(kind="critic", config=cfg, host=cfg.deploy.critic.host, port=port,
                      torch_threads=server_threads(cfg))
    server = launch(spec, RESULTS / "tmp" / "critic-server.log")
    log(f"critic server ready at {server.url} in {time.perf_counter() - started:.1f} s")
    client = critic_backend(cfg, url=server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


@contextmanager
def local_critic(cfg):
    critic = LocalCritic(build_critic_trainer(cfg))
    try:
        yield critic
    finally:
        critic.close()


class PPORunner:
    """One actor + one critic backend + its own prompt stream; `run(n)` times n PPO iterations."""

    def __init__(self, cfg, critic):
        self.cfg, self.critic = cfg, critic
        self.state = build_actor(cfg)
        self.batches = prompt_batches(load_prompts(cfg), cfg.ppo.rollout_batch_size, cfg.seed)

    def run(self, iterations: int, warmup: int = 1) -> list[dict]:
        records = []
        for i in range(warmup + iterations):
            prompts = next(self.batches)
            start = time.perf_counter()
            metrics, _ = train_step(self.state, prompts, self.cfg, Backends(critic=self.critic))
            seconds = time.perf_counter() - start
            if i >= warmup:
                records.append({"seconds": seconds, "tokens": metrics["tokens/generated"],
                                "phases": {p: metrics.get(f"time/{p}", 0.0) for p in PHASES}})
        return records


def summarize(records: list[dict]) -> dict:
    return {"seconds_per_iteration": stats([r["seconds"] for r in records]),
            "phases_seconds": {p: stats([r["phases"][p] for r in records]) for p in PHASES}}


def auth_round_trips(quick: bool, secret_first: bool = False) -> dict:
    """critic_infer round trips, open mode vs the run's secret, same build, same machine, alternating."""
    pairs, warmup = (60, 10) if quick else (400, 30)
    cfg = pin(RLHFConfig.model_validate({"deploy": {"state_dir": str(RESULTS / "tmp" / "auth-state")}}))
    secret = new_secret()
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    ports = [find_free_ports()]
    while len(ports) < 2:
        if abs((port := find_free_ports()) - ports[0]) >= 3:
            ports.append(port)
    specs = {"open": ServerSpec(kind="critic", config=merge(cfg, {"deploy.critic.auth": "none"}), port=ports[0],
                                torch_threads=1),
             "secret": ServerSpec(kind="critic", config=cfg, port=ports[1], torch_threads=1)}
    order = ("secret", "open") if secret_first else ("open", "secret")  # which server starts first (and its ports)
    servers = {side: launch(specs[side].model_copy(update={"port": port}), RESULTS / "tmp" / f"critic-{side}.log",
                            secret=secret) for side, port in zip(order, ports)}
    clients = {"open": CriticClient(servers["open"].url, secret=""),  # no header, as every client sent before
               "secret": CriticClient(servers["secret"].url, secret=secret)}
    rng = np.random.default_rng(0)
    out = {}
    try:
        for rows, width in ((1, 8), (32, 64)):
            tokens = rng.integers(4, 40, (rows, width)).astype(np.int64)
            lengths = np.full((rows, 1), width, np.int64)
            seconds = {"open": [], "secret": []}
            for i in range(warmup + pairs):
                for side in (("open", "secret") if i % 2 == 0 else ("secret", "open")):  # ABBA
                    started = time.perf_counter()
                    clients[side].infer(tokens, lengths)
                    if i >= warmup:
                        seconds[side].append(time.perf_counter() - started)
            ratio = stats([s / o for s, o in zip(seconds["secret"], seconds["open"])])
            out[f"{rows}x{width}"] = {"open_ms": stats([1e3 * s for s in seconds["open"]]),
                                      "secret_ms": stats([1e3 * s for s in seconds["secret"]]),
                                      "per_pair_ratio_secret_over_open": ratio,
                                      "median_overhead_ms": statistics.median(seconds["secret"]) * 1e3
                                      - statistics.median(seconds["open"]) * 1e3}
            log(f"critic_infer {rows}x{width}: open {statistics.median(seconds['open']) * 1e3:.2f} ms, secret "
                f"{statistics.median(seconds['secret']) * 1e3:.2f} ms (median per-pair ratio {ratio['median']:.3f})")
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
    result = {"quick": quick, "what": "seconds per critic_infer round trip (tritonclient HTTP, a new connection per "
                                      "call as CriticClient makes), open mode vs the run's secret, one server each",
              "repetitions": {"pairs": pairs, "warmup_pairs_discarded": warmup, "order": "alternating, ABBA",
                              "started_first": order[0]},
              "settings": {"server_torch_threads": 1, "models": "tiny/critic + tiny/reward (combined)",
                           "note": "the machine's 2 cores were shared with other engineers' work during the run"},
              "round_trips": out}
    write_result("critic_http_auth" + ("_secret_first" if secret_first else ""), result)
    return result


def main(argv=None) -> dict:
    if argv is None and "--auth" in sys.argv:
        return auth_round_trips("--quick" in sys.argv, "--secret-first" in sys.argv)
    quick = quick_flag(argv)
    pairs = 8 if quick else 80
    cfg = bench_config()
    got = {"in_process": [], "http": []}
    with local_critic(cfg) as local, http_critic(cfg) as remote:
        runners = {"in_process": PPORunner(cfg, local), "http": PPORunner(cfg, remote)}
        for runner in runners.values():
            runner.run(0, warmup=1)
        for i in range(pairs):
            for side in (("in_process", "http") if i % 2 == 0 else ("http", "in_process")):  # ABBA
                got[side] += runners[side].run(1, warmup=0)
    ratio = stats([h["seconds"] / p["seconds"] for h, p in zip(got["http"], got["in_process"])])
    log(f"critic_http: in-process {statistics.median(x['seconds'] for x in got['in_process']):.3f} s/it, HTTP "
        f"{statistics.median(x['seconds'] for x in got['http']):.3f} s/it, median pair ratio {ratio['median']:.2f}")
    result = {
        "quick": quick,
        "what": "seconds per PPO iteration (models.step.train_step), critic over HTTP (PyTriton child process) "
                "/ in process",
        "repetitions": {"pairs": pairs, "warmup_iterations_discarded_per_side": 1,
                        "order": "interleaved per iteration, ABBA"},
        "settings": {"rollout_batch_size": cfg.ppo.rollout_batch_size, "minibatch_size": cfg.ppo.minibatch_size,
                     "epochs": cfg.ppo.epochs, "max_new_tokens": cfg.generation.max_new_tokens,
                     "micro_batch_size": cfg.generation.micro_batch_size, "critic_epochs": cfg.critic.epochs,
                     "critic_train_batch_size": cfg.critic.train_batch_size,
                     "combine_reward": cfg.critic.combine_reward,
                     "max_queue_delay_us": cfg.deploy.critic.max_queue_delay_us,
                     "critic_micro_batch_size": cfg.critic.micro_batch_size,
                     "server_torch_threads": server_threads(cfg), "actor_torch_threads": torch.get_num_threads()},
        "in_process": summarize(got["in_process"]),
        "http": summarize(got["http"]),
        "time_ratio_http_over_in_process": ratio,
        "time_ratio_of_medians": statistics.median(x["seconds"] for x in got["http"])
        / statistics.median(x["seconds"] for x in got["in_process"]),
        "target": f"median per-pair ratio <= {TARGET}",
        "target_met": ratio["median"] <= TARGET,
    }
    write_result("critic_http", result)
    return result


if __name__ == "__main__":
    main()
