"""What-if experiments behind the recommendations in docs/benchmarks.md. The library is unchanged; each change is
applied here, in the benchmark process only, and measured against the default in the same interleaved way as the
benchmarks.

(Fused AdamW, measured here before as a what-if at 0.68-0.70x TRL's time per RLOO iteration, is now the default:
models/loading.make_optimizer.)

Actor threads for PPO with a co-located critic. The actor uses torch's default (every core); the critic server
   child gets the flows' default (1 thread on a CPU-only host); an in-process critic thread shares the actor's
   process-wide thread count. While actor and critic overlap, the cores are oversubscribed. "split" gives the actor
   half the cores (torch.set_num_threads, process-wide). Default and split alternate per iteration. Control: the
   same for an RLOO iteration (one process, no critic), run first, before any critic exists.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch

from benchmarks.common import log, quick_flag, stats, write_result
from benchmarks import critic_http, rloo_vs_trl


def thread_split(quick: bool) -> dict:
    pairs = 6 if quick else 30
    cores = os.cpu_count() or 1
    default_threads = torch.get_num_threads()
    split_threads = max(1, cores // 2)
    cfg = critic_http.bench_config()
    out = {"cores": cores, "actor_threads": {"default": default_threads, "split": split_threads},
           "http_server_threads": critic_http.server_threads(cfg),
           "repetitions": {"pairs": pairs, "warmup_per_side": 1}}
    threads = {"default": default_threads, "split": split_threads}
    rloo_cfg = rloo_vs_trl.bench_config(lr=rloo_vs_trl.FIXED_POLICY_LR)
    with ExitStack() as stack:

        def cases():  # created lazily: the control runs before any critic exists in or next to this process
            yield "rloo_no_critic", {name: rloo_vs_trl.OurRLOO(rloo_cfg) for name in ("default", "split")}
            server = stack.enter_context(critic_http.http_critic(cfg))  # both HTTP runners use this one server
            yield "http", {name: critic_http.PPORunner(cfg, server) for name in ("default", "split")}
            yield "in_process", {name: critic_http.PPORunner(cfg, stack.enter_context(critic_http.local_critic(cfg)))
                                 for name in ("default", "split")}

        try:
            for case, runners in cases():
                got = {"default": [], "split": []}
                for i in range(pairs + 1):
                    for name in (("default", "split") if i % 2 == 0 else ("split", "default")):
                        torch.set_num_threads(threads[name])
                        runner = runners[name]
                        records = ([runner.iteration()] if isinstance(runner, rloo_vs_trl.OurRLOO)
                                   else runner.run(1, warmup=0))
                        if i:  # the first pair is the warm-up
                            got[name] += records
                out[case] = {name: {"seconds_per_iteration": stats([r["seconds"] for r in records]),
                                    "phases_seconds": {p: stats([r["phases"][p] for r in records])
                                                       for p in records[0]["phases"]}}
                             for name, records in got.items()}
                out[case]["split_over_default"] = stats([s["seconds"] / d["seconds"]
                                                         for s, d in zip(got["split"], got["default"])])
                log(f"what_if actor threads, {case}: {default_threads} threads "
                    f"{out[case]['default']['seconds_per_iteration']['median']:.3f} s/it, {split_threads} "
                    f"{out[case]['split']['seconds_per_iteration']['median']:.3f} s/it "
                    f"(pair ratio {out[case]['split_over_default']['median']:.2f})")
        finally:
            torch.set_num_threads(default_threads)
    return out


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    result = {"quick": quick,
              "what": "library changes applied in the benchmark process only, measured against the default",
              "thread_split_ppo": thread_split(quick)}
    write_result("what_if", result)
    return result


if __name__ == "__main__":
    main()
