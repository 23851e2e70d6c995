"""Run every benchmark, write benchmarks/results/*.json and the results table in docs/benchmarks.md.

    python -m benchmarks.run_all            # full run (~5 min on a 2-core CPU), updates docs/benchmarks.md
    python -m benchmarks.run_all --quick    # fewer repetitions (~2 min); results go to benchmarks/results/tmp/quick/
    python -m benchmarks.run_all --only rloo_vs_trl critic_http

Exits non-zero when a benchmark fails to run, never because a target was missed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

from benchmarks.common import ROOT, load_average, log, machine, results_dir, versions

BENCHMARKS = ("generate", "rollout_engine", "async_rollouts", "rloo_vs_trl", "grpo_vs_trl", "recipes", "stages_vs_trl",
              "dpo_vs_trl", "pipeline_cache",
              "critic_http", "overlap", "what_if", "distributed", "critic_ranks", "memory", "gpu")
# results measured on their own (not by run_all): `python -m benchmarks.memory --lora --baseline DIR` (two checkouts)
MEASURED_APART = ("memory_lora",)
PAGE = ROOT / "docs" / "benchmarks.md"
MARK_START, MARK_END = "<!-- results:start (written by python -m benchmarks.run_all) -->", "<!-- results:end -->"


def fmt(s: dict, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """'median [min–max] unit' of a stats dict."""
    return (f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]{unit}")


def load_results(directory=None) -> dict:
    """Every benchmark's latest result file (benchmarks/results/<name>.json), by name."""
    directory = directory or results_dir(False)
    return {name: json.loads((directory / f"{name}.json").read_text()) for name in BENCHMARKS + MEASURED_APART
            if (directory / f"{name}.json").exists()}


def memory_rows(r: dict, label: str) -> list[list[str]]:
    rows = []
    for row in r:
        setting = f"{row['dtype']}{' + checkpointing' if row['gradient_checkpointing'] else ''}"
        shape = f"B={row['batch']} L={row['seq_len']}"
        if "failed" in row:
            rows.append([f"{label}, {shape}: {setting}", "peak memory; saved for backward; s/step",
                         "out of memory" if row.get("out_of_memory") else f"failed: {row['failed']}", "—", "—", ""])
            continue
        peak = row.get("peak_bytes", row.get("peak_rss_bytes"))
        kind = "peak allocated" if "peak_bytes" in row else "peak RSS"
        rows.append([f"{label}, {shape}: {setting}", f"{kind}; activations saved for backward; s/step",
                     f"{peak / 2**30:.2f} GiB; {row['saved_for_backward_bytes'] / 2**20:.0f} MiB; "
                     f"{fmt(row['seconds_per_step'])}", f"{row['seconds_per_step']['n']} steps", "—", ""])
    return rows


def step_rows(title: str, c: dict, reps: dict) -> list[list[str]]:
    """The rows of one optimizer step of ours against one of TRL's trainers on the same batches (target <= 1.0)."""
    n = f"{reps['rounds']} rounds x {reps['timed_steps_per_round_per_side']} pairs"
    return [[title, "time ours / TRL (per pair, same batch)", fmt(c["time_ratio_ours_over_trl"]), n, "<= 1.0",
             "yes" if c["time_ratio_ours_over_trl"]["median"] <= 1.0 else "**no**"],
            ["", "ms/step: ours vs TRL", f"{fmt(c['ours_seconds_per_step'], 1e3, 1)} vs "
             f"{fmt(c['trl_seconds_per_step'], 1e3, 1)}", n, "", ""]]


def table(results: dict) -> str:
    """The generated part of docs/benchmarks.md: when and where each result was measured, the results table and the
    phase tables, from the result files alone."""
    rows = []
    r = results.get("rloo_vs_trl")
    if r:
        reps = r["repetitions"]
        n = f"{reps['rounds']} rounds x {reps['timed_iterations_per_round_per_side']} pairs"
        rows.append(["RLOO iteration vs TRL 1.16 RLOOTrainer", "time ours / TRL (per pair), fixed policy",
                     fmt(r["time_ratio_ours_over_trl"]), n, "<= 0.70", _met(r)])
        rows.append(["", "s/iteration: ours vs TRL", f"{fmt(r['ours']['seconds_per_iteration'], digits=3)} vs "
                     f"{fmt(r['trl']['seconds_per_iteration'], digits=3)}", n, "", ""])
        rows.append(["", "generated tokens/s ratio ours / TRL", fmt(r["tokens_per_second_ratio_ours_over_trl"]), n,
                     "", ""])
        if r.get("learning"):
            lr = r["learning"]
            n = f"{reps.get('learning_rounds', '?')} rounds x {reps['timed_iterations_per_round_per_side']} pairs"
            rows.append(["", "learning (configured lr): time ours / TRL", fmt(lr["time_ratio_ours_over_trl"]), n,
                         "", ""])
            rows.append(["", "learning: generated tokens/iteration ours vs TRL",
                         f"{fmt(lr['ours']['generated_tokens_per_iteration'], digits=0)} vs "
                         f"{fmt(lr['trl']['generated_tokens_per_iteration'], digits=0)}", n, "", ""])
    r = results.get("grpo_vs_trl")
    if r:
        reps = r["repetitions"]
        n = f"{reps['rounds']} rounds x {reps['timed_iterations_per_round_per_side']} pairs"
        for name, c in r["recipes"].items():
            trl = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c["trl"].items())
            rows.append([f"{name} iteration vs TRL 1.16 GRPOTrainer ({trl})" if name == next(iter(r["recipes"]))
                         else f"{name} vs GRPOTrainer ({trl})", "time ours / TRL (per pair), fixed policy",
                         fmt(c["time_ratio_ours_over_trl"]), n, "<= 0.70",
                         "yes" if c["target_met"] else "**no**"])
    r = results.get("recipes")
    if r:
        kernels = ", ".join(r["runs"])
        n = f"seeds {', '.join(map(str, r['seeds']))} x kernels {kernels}"
        for task, recipes in r["summary"].items():
            for name, by_kernels in recipes.items():
                values = [v for stats_ in by_kernels.values() for v in (stats_["min"], stats_["median"], stats_["max"])]
                low = min(stats_["min"] for stats_ in by_kernels.values())
                median = sorted(stats_["median"] for stats_ in by_kernels.values())[len(by_kernels) // 2]
                what = "share of the gap to its RL teacher closed (held-out)" if name == "opd" else \
                    "share of the gold headroom closed in 12 iterations"
                target = 0.5 if name == "opd" else 0.3
                rows.append([f"learning: {name}, {task} task" if name == "ppo" else f"{name}, {task}", what,
                             f"{median:.2f} [{low:.2f}–{max(values):.2f}]", n, f">= {target}",
                             "yes" if low >= target else ("median only" if median >= target else "**no**")])
    r = results.get("stages_vs_trl")
    if r:
        for stage, trainer in (("sft", "SFTTrainer"), ("reward_model", "RewardTrainer")):
            rows += step_rows(f"{'SFT' if stage == 'sft' else 'Reward-model'} step vs TRL 1.16 {trainer}", r[stage],
                              r["repetitions"])
    r = results.get("dpo_vs_trl")
    if r:
        reps = r["repetitions"]
        rows += step_rows("DPO step vs TRL 1.16 DPOTrainer", r, reps)
        worst = max(d for check in r["same_computation"] for d in check["max_abs_difference_per_step"])
        rows.append(["", "TRL's metrics (rewards/*, logps/*) ours vs TRL's, warm-up steps: largest difference",
                     f"{worst:.1e}", f"{reps['rounds']} rounds x {reps['warmup_steps_discarded_per_round']} steps",
                     "float32", ""])
    r = results.get("pipeline_cache")
    if r:
        n = f"{r['repetitions']['rounds']} rounds"
        rows.append(["Pipeline (examples/pipeline.yaml): rerun with an RL setting changed", "wall time / first run's",
                     fmt(r["rl_only_ratio"], 100, 0, " %"), n, "< 40 %", _met(r)])
        rows.append(["", "CPU time / first run's; inside the pipeline (no process start) / first's",
                     f"{fmt(r['rl_only_cpu_ratio'], 100, 0, ' %')}; {fmt(r['rl_only_pipeline_ratio'], 100, 0, ' %')}",
                     n, "", ""])
        rows.append(["", "wall s: first run vs RL-only rerun vs new preference data vs all reused",
                     f"{fmt(r['first_s'], digits=0)} vs {fmt(r['rl_only_s'], digits=0)} vs "
                     f"{fmt(r['new_data_s'], digits=0)} vs {fmt(r['all_cached_s'], digits=0)}", n, "", ""])
        rows.append(["", "reward model: held-out pair accuracy (500 pairs never trained on)",
                     fmt(r["reward_model_held_out_accuracy"], digits=3), n, ">= 0.8",
                     "yes" if r["reward_model_held_out_accuracy"]["min"] >= 0.8 else "**no**"])
    r = results.get("critic_http")
    if r:
        n = f"{r['repetitions']['pairs']} pairs"
        rows.append(["PPO iteration, critic over HTTP vs in process", "time HTTP / in-process (per pair)",
                     fmt(r["time_ratio_http_over_in_process"]), n, "<= 1.10", _met(r)])
        rows.append(["", "s/iteration: in-process vs HTTP", f"{fmt(r['in_process']['seconds_per_iteration'], digits=3)}"
                     f" vs {fmt(r['http']['seconds_per_iteration'], digits=3)}", n, "", ""])
    r = results.get("overlap")
    if r:
        n = f"{r['repetitions']['iterations_per_side']} it/side"
        rows.append(["Overlap: critic_infer hidden behind actor logprob/reference", "fraction (HTTP critic)",
                     fmt(r["infer_hidden_fraction_http"], 100, 0, " %"), n, ">= 80 %", _met(r)])
        rows.append(["", "fraction (in-process critic)",
                     fmt(r["in_process"]["per_iteration_stats"]["infer_hidden_fraction"], 100, 0, " %"), n, "", ""])
        rows.append(["Overlap: critic_train hidden behind actor train", "fraction: HTTP vs in-process",
                     f"{fmt(r['train_hidden_fraction_http'], 100, 0, ' %')} vs "
                     f"{fmt(r['in_process']['per_iteration_stats']['train_hidden_fraction'], 100, 0, ' %')}", n, "—",
                     ""])
    r = results.get("generate")
    if r:
        for case in r["cases"]:
            rows.append([f"Rollout B={case['batch']}, {case['max_new_tokens']} new tokens",
                         "tokens/s: Policy.generate vs HF generate",
                         f"{fmt(case['ours_tokens_per_s'], digits=0)} vs {fmt(case['hf_tokens_per_s'], digits=0)} "
                         f"(x{case['speedup_tokens_per_s']:.2f})",
                         f"{r['repetitions']['reps_per_side_per_case']} reps/side", "—", ""])
    r = results.get("rollout_engine")
    if r:
        for name, model in r["models"].items():
            for case in model["cases"]:
                n = f"{r['repetitions']['reps_per_side_per_case']} reps/side"
                rows.append([f"vLLM rollout server vs native, {name} {case['dtype']}", "tokens/s: vLLM vs native",
                             f"{fmt(case['vllm_tokens_per_s'], digits=0)} vs "
                             f"{fmt(case['native_tokens_per_s'], digits=0)} (x{case['speedup_vllm_over_native']:.2f})",
                             n, "—", ""])
                small = case["refit_bytes"] < 64 * 2**20  # below what peak RSS resolves (pages, allocator arenas)
                for transport, refit in case["refit"].items():
                    peak = max(refit["rank0_peak_extra_model_copies"], refit["server_peak_extra_model_copies"])
                    rows.append(["", f"refit over {transport}: seconds; peak RSS above the level before, in model "
                                 f"copies (rank 0 / server)", f"{fmt(refit['seconds'])} s; "
                                 f"{refit['rank0_peak_extra_model_copies']:.2f} / "
                                 f"{refit['server_peak_extra_model_copies']:.2f}"
                                 + (f" (of {case['refit_bytes'] / 2**20:.1f} MiB: RSS noise)" if small else ""),
                                 f"{refit['seconds']['n']} refits", "—" if small else "<= 1 copy each side",
                                 "" if small else "yes" if peak <= 1 else "**no**"])
        it = r["rloo_iteration_qwen2_110m_64_tokens"]
        for side in [k.removesuffix("_refit_share_of_iteration") for k in it
                     if k.endswith("_refit_share_of_iteration")]:
            share = it[f"{side}_refit_share_of_iteration"]
            rows.append([f"Refit share of an RLOO iteration (110M, float32, {side})", "refit / iteration",
                         fmt(share, 100, 1, " %"), f"{share['n']} iterations", "<= 5 %",
                         "yes" if share["median"] <= 0.05 else "**no**"])
    r = results.get("async_rollouts")
    if r:
        for part in [p for p in ("throughput", "throughput_balanced") if p in r]:
            sizes = r[part]["sizes"]
            shape = (f"{sizes['reinforce.rollout_batch_size']}x{sizes['reinforce.num_rollouts_per_prompt']}x"
                     f"{sizes['generation.max_new_tokens']} tokens")
            for name, c in r[part]["cases"].items():
                extra = (f" (x{c['speedup_over_k0']:.2f} of k=0; ideal x{c['ideal_speedup']:.2f}: "
                         f"{c['share_of_ideal']:.0%} of it)" if "speedup_over_k0" in c else "")
                rows.append([f"Asynchronous rollouts, RLOO 110M {shape}, {name} (actor cores {c['actor_cores']}, "
                             f"server {c['server_cores']})", "iterations/min; rollout wait; engine idle (s/iteration)",
                             f"{c['iterations_per_minute']:.2f}{extra}; {c['rollout_wait_s']['median']:.1f}; "
                             f"{c['engine_idle_s']['median']:.1f}", f"{c['measured_iterations']} iterations",
                             ">= 1.5x k=0, >= 85 % of ideal" if name == "k1" else "—",
                             ("yes" if c["speedup_over_k0"] >= 1.5 and c["share_of_ideal"] >= 0.85 else "**no**")
                             if name == "k1" else ""])
        g = r["learning"]
        rows.append(["Asynchronous rollouts: learning at equal samples (tiny, RLOO, 12 it)",
                     f"mean gold gain k=0 vs k=1 over seeds {g['seeds']}",
                     f"{g['gold_gain']['k0']['mean']:+.3f} vs {g['gold_gain']['k1']['mean']:+.3f} "
                     f"(diff {g['mean_gain_k1_minus_k0']:+.3f})", f"{len(g['seeds'])} seeds each", "within 0.05",
                     "yes" if abs(g["mean_gain_k1_minus_k0"]) <= 0.05 else "**no**"])
    r = results.get("what_if")
    if r:
        t = r["thread_split_ppo"]
        for case, label in (("http", "PPO, HTTP critic"), ("in_process", "PPO, in-process critic"),
                            ("rloo_no_critic", "RLOO, no critic (control)")):
            if case not in t:
                continue
            c = t[case]
            rows.append([f"What-if: actor torch threads {t['actor_threads']['default']} -> "
                         f"{t['actor_threads']['split']} ({label})", "s/iteration: default vs fewer (pair ratio)",
                         f"{fmt(c['default']['seconds_per_iteration'], digits=3)} vs "
                         f"{fmt(c['split']['seconds_per_iteration'], digits=3)} "
                         f"(x{c['split_over_default']['median']:.2f})",
                         f"{t['repetitions']['pairs']} pairs", "—", ""])
    r = results.get("distributed")
    if r:
        n = f"{r['settings']['rounds']} rounds x {r['settings']['iterations_per_run'] - 1} it"
        for algorithm in ("ppo", "rloo"):
            t = r["seconds_per_iteration"][algorithm]
            rows.append([f"Actor on 1 vs 2 ranks (FSDP2, gloo): {algorithm.upper()}", "s/iteration: 1 vs 2 ranks",
                         f"{fmt(t['1_ranks_seconds_per_iteration'], digits=3)} vs "
                         f"{fmt(t['2_ranks_seconds_per_iteration'], digits=3)} (x{t['ratio_2_over_1']:.2f})", n,
                         "(none on 2 cores)", ""])
        f = r["memory_fraction_of_1_rank_per_rank_of_2"]
        rows.append([f"Per-rank memory, {r['settings']['memory_model']}", "each of 2 ranks / 1 rank: params, grads, "
                     "AdamW", ", ".join(f"{k} {min(v):.2f}-{max(v):.2f}" for k, v in f.items()), "1 run",
                     "about 0.5", "yes" if r["target_met"] else "no"])
    r = results.get("critic_ranks")
    if r:
        c, n = r["critic_round_trip_seconds"], f"{r['settings']['repetitions']} alternated pairs"
        for op in ("infer", "train"):
            rows.append([f"Critic server on 1 vs 2 ranks: critic_{op} {tuple(r['settings']['batch'])}",
                         "round trip: 1 vs 2 ranks", f"{fmt(c['1_ranks'][op], 1e3, 1, ' ms')} vs "
                         f"{fmt(c['2_ranks'][op], 1e3, 1, ' ms')} (x{c[f'{op}_ratio_2_over_1']:.2f})", n,
                         "(none on 2 cores)", ""])
        t = r["reward_transport_seconds"]
        rows.append(["Rewards as text vs tokens (same rollouts)", "reward_text vs reward_model round trip",
                     f"{fmt(t['text'], 1e3, 1, ' ms')} vs {fmt(t['tokens'], 1e3, 1, ' ms')} "
                     f"(x{t['text_over_tokens']:.2f})",
                     n, "—", ""])
    r = results.get("memory")
    if r:
        params = r["model"]["parameters"]
        rows += memory_rows(r["settings"], f"Memory, {params / 1e6:.0f}M Qwen2-shaped, {r['device']}")
    r = results.get("memory_lora")
    if r:
        params = r["model"]["parameters"]
        for row in r["settings"]:
            rows.append([f"LoRA r={row['lora']['r']}, model.dtype=bfloat16, {params / 1e6:.0f}M Qwen2-shaped, "
                         f"{r['device']} ({row['code']})", "frozen base; adapters; peak RSS; s/step",
                         f"{row['frozen_bytes'] / 2**20:.0f} MiB {'/'.join(row['frozen_dtypes'])}; "
                         f"{row['trainable_bytes'] / 2**20:.1f} MiB; {row['peak_rss_bytes'] / 2**30:.2f} GiB; "
                         f"{fmt(row['seconds_per_step'])}", f"{row['seconds_per_step']['n']} steps", "—", ""])
    r = results.get("gpu")
    if r:
        if r.get("skipped"):
            rows.append(["GPU decode roofline / training MFU", "—", f"skipped: {r['skipped']}", "—", "—", ""])
        else:
            for d in r["decode"]:
                rows.append([f"GPU decode B={d['batch']} ({d['sampling']})", "tokens/s (fraction of roofline)",
                             f"{d['tokens_per_s']['median']:.0f} ({d['fraction_of_roofline']:.0%})",
                             f"{d['tokens_per_s']['n']} reps", "—", ""])
            for t in r["train"]:
                mfu = f"{t['mfu']:.0%}" if t["mfu"] is not None else "n/a"
                rows.append([f"GPU train B={t['batch']} L={t['seq_len']}", "TFLOP/s (MFU)",
                             f"{t['achieved_tflops']:.1f} ({mfu})", f"{t['seconds_per_step']['n']} reps", "—", ""])
            rows += memory_rows(r.get("memory", []), "GPU memory, ~0.5B")
    lines = [MARK_START, "", "Generated from benchmarks/results/*.json (`python -m tools.docs`; `python -m "
             "benchmarks.run_all` after a run). Each file says when, where and under what load it was measured:", "",
             "| Result file | Measured | Machine | torch | Load average (1 min) at the end |", "|---|---|---|---|---|"]
    for name, r in results.items():
        m = r.get("machine", {})
        machine = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, GPU: {m.get('gpu') or 'none'}"
        load = (r.get("load_average_1_5_15_min_at_end") or ["?"])[0]
        lines.append(f"| {name}.json | {r.get('created', '?')[:16].replace('T', ' ')} | {machine} | "
                     f"{r.get('versions', {}).get('torch', '?')} | {load} |")
    lines += ["", "Values: median [min–max].", "",
              "| Benchmark | Measure | Result | Repetitions | Target | Met |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines += phase_tables(results)
    lines += ["", MARK_END]
    return "\n".join(lines)


def phase_tables(results: dict) -> list[str]:
    """Median seconds per phase (the time/* metrics of our steps, TRL's timed methods) and the RLOO settings."""
    lines = []
    r = results.get("rloo_vs_trl")
    if r:
        names = list(r["ours"]["phases_seconds"])
        lines += ["", "RLOO phases (fixed policy), median seconds per iteration. Ours: the step's time/* metrics, the "
                  "optimizer step timed with optimizer step hooks; TRL: its `_generate`, `_generate_and_score_"
                  "completions` minus generation, `training_step` minus the rollout, the optimizer step between "
                  "`on_pre_optimizer_step` and `on_optimizer_step`; other = the rest of the iteration (grad clipping, "
                  "LR schedule, the trainer loop; ours has grad clipping and the LR schedule inside its time/train, "
                  "i.e. in the forward+backward column).", "",
                  "| Side | " + " | ".join(names) + " | total |", "|---" * (len(names) + 2) + "|"]
        for side, label in (("ours", "ours"), ("trl", "TRL")):
            phases = r[side]["phases_seconds"]
            lines.append(f"| {label} | "
                         + " | ".join(f"{phases[n]['median']:.3f}" if n in phases else "—" for n in names)
                         + f" | {r[side]['seconds_per_iteration']['median']:.3f} |")
        if r.get("ours_top_ops_torch_profiler"):
            lines += ["", "Our RLOO iteration, top ops by self CPU time (torch.profiler, ms per iteration): "
                      + ", ".join(
                f"`{o['op']}` {o['self_cpu_ms_per_call']:.1f}" for o in r["ours_top_ops_torch_profiler"][:8]) + "."]
        lines += ["", "RLOO settings, ours vs TRL:", "", "| Setting | Ours | TRL RLOOTrainer |", "|---|---|---|"]
        for name, (ours, trl) in r["settings_ours_vs_trl"].items():
            lines.append(f"| {name} | {ours} | {trl} |")
    r = results.get("critic_http")
    if r:
        names = list(r["in_process"]["phases_seconds"])
        lines += ["", "PPO phases, median s/iteration (time/* metrics of a PPO iteration):", "",
                  "| Critic | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for side in ("in_process", "http"):
            lines.append(f"| {side} | " + " | ".join(f"{r[side]['phases_seconds'][n]['median']:.3f}" for n in names)
                         + " |")
    return lines


def _met(r: dict) -> str:
    return "yes" if r.get("target_met") else "**no**"


def update_markdown(text: str, path=PAGE) -> None:
    current = path.read_text() if path.exists() else "# Benchmarks\n\n" + MARK_START + "\n" + MARK_END + "\n"
    if MARK_START in current and MARK_END in current:
        before, rest = current.split(MARK_START, 1)
        after = rest.split(MARK_END, 1)[1]
        current = before + text + after
    else:
        current = current.rstrip() + "\n\n" + text + "\n"
    path.write_text(current)
    log(f"updated {path.relative_to(ROOT)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; results to results/tmp/quick/")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    seconds, load_before, failed = {}, {}, []
    for name in args.only or BENCHMARKS:
        load_before[name] = load_average()
        log(f"=== {name} (load average {load_before[name]})")
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            module.main(["--quick"] if args.quick else [])
        except Exception:  # noqa: BLE001 - report, run the others, exit non-zero at the end
            traceback.print_exc()
            failed.append(name)
        seconds[name] = time.perf_counter() - t0
        log(f"=== {name} done in {seconds[name]:.0f} s" + (" (FAILED)" if name in failed else ""))
    summary = {"quick": args.quick, "only": args.only, "finished": time.strftime("%Y-%m-%d %H:%M %Z"),
               "total_seconds": time.perf_counter() - started, "seconds": seconds, "load_before": load_before,
               "failed": failed, "machine": machine(), "versions": versions()}
    directory = results_dir(args.quick)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run_all.json").write_text(json.dumps(summary, indent=2) + "\n")
    # the table from the files (a partial run, --only, keeps the other benchmarks' previous results)
    text = table(load_results(directory))
    if args.quick:
        print(text)
    else:
        update_markdown(text)
    log(f"all done in {summary['total_seconds'] / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
