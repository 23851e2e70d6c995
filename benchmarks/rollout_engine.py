"""Rollout engines side by side: the native KV-cache loop (on the actor's module) against the vLLM rollout server.

Models: the tiny policy, and a ~110M Qwen2-shaped model built from config with random weights (saved with
save_pretrained, loaded by both sides through from_pretrained, as a user's model would be). For each model and dtype
(float32, bfloat16):
- generation tokens/s: the same prompt token ids (32 prompts), 64 new tokens at temperature 1, alternating sides;
  the vLLM side's time is the whole HTTP round trip from rank 0 (request, sampling, answer, unpacking).
- refit over each weight transfer (`http`: a safetensors body streamed as the tensors come; `dist`: a gloo group of
  two, tensors broadcast one at a time and loaded as they arrive): seconds (gather, send, reload in vLLM, clear the
  prefix cache), and the peak RSS above its level before the refit of both processes, rank 0 (this one) and the
  server, as read from the kernel's high-water mark (VmHWM, reset before each refit through /proc/<pid>/clear_refs).
And the whole RLOO iteration (rollout_batch_size 8 prompts x k 4, 64-token responses, reward from a function) on the
110M model with each engine (vLLM over each transfer), alternating, with the share of the iteration the refit takes.

Both sides get every core, as in a run: the native side torch's default, the server its default on a CPU host
(rollout.vllm.threads; the actor waits while the server generates). On a GPU, the server takes 30% of the GPU memory
(rollout.vllm.gpu_memory_utilization).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from benchmarks.common import log, quick_flag, stats, tiny_config, write_result
from components.serving.launcher import launch_rollout, rollout_env
from components.serving.rollout.client import RolloutClient
from models.config import Sampling, merge
from models.engines import NativeEngine, VLLMEngine
from models.loop import Leader, batch_size, build_actor, build_local_reward, load_prompts, prompt_batches
from models.policy import Policy

TRANSPORTS = ("http", "dist")
RUN = "benchmark/rollout-engine"


def qwen2_110m(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab_size, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                       tie_word_embeddings=True)


def build_random_model(directory: Path, tokenizer_dir: str, vocab_size: int = 32000) -> int:
    """A ~110M Qwen2-shaped model with random weights and the tiny tokenizer, saved where from_pretrained reads it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen2_110m(vocab_size), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def time_generation(engine, prompt_ids, gen, generator) -> dict:
    start = time.perf_counter()
    rollout = engine.generate(prompt_ids, 1, gen, generator)
    if rollout.tokens.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int(rollout.response_lengths.sum())}


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident set (VmRSS) or its peak since the last reset (VmHWM), from /proc, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the kernel's peak-RSS reset (Linux >= 4.0)


def measured_refit(engine: VLLMEngine, policy: Policy, server_pid: int) -> dict:
    """One refit of the policy's weights, with the peak RSS above the level before it of this process and the
    server's."""
    pids = {"rank0": os.getpid(), "server": server_pid}
    before = {}
    for name, pid in pids.items():
        reset_peak(pid)
        before[name] = rss_bytes(pid)
    engine.update_weights(policy.engine_weights())
    peaks = {name: rss_bytes(pid, "VmHWM") - before[name] for name, pid in pids.items()}
    return {**engine.last_refit, **{f"{name}_peak_extra_bytes": peak for name, peak in peaks.items()}}


def compare_generation(cfg, model_dir: str, dtype: str, reps: int, prompts: list[str], new_tokens: int,
                       device: str = "cpu") -> dict:
    """Native engine (on `device`) against the vLLM server (its own process, GPU when there is one) on `model_dir`:
    tokens/s over alternating repetitions after a warm-up each, and the refit over each transport (seconds, peak
    RSS of both sides)."""
    policy = Policy.load(model_dir, dtype=dtype, device=device)
    ids = policy.encode_prompts(prompts)
    gen = Sampling(max_new_tokens=new_tokens, temperature=1.0)
    native = NativeEngine.for_policy(policy)
    vcfg = merge(cfg, {"model.policy": model_dir, "rollout.vllm.dtype": dtype, "deploy.rollout.port": 0})
    with (tempfile.TemporaryDirectory(prefix="rollout-bench-") as logs,
          launch_rollout(vcfg, Path(logs) / "server.log") as server):
        started = time.perf_counter()
        server.wait_until_ready(vcfg.deploy.rollout.ready_timeout_s)
        ready_s = time.perf_counter() - started
        vllm = VLLMEngine(policy.pad_id, policy.stop_ids, weights_dtype=dtype)
        client = RolloutClient(server.url, RUN)
        vllm.connect(client)
        http = client.transport
        client.use_dist("127.0.0.1")
        dist = client.transport
        refits = {transport: [] for transport in TRANSPORTS}
        for rep in range(max(3, reps)):  # alternating transports, the first of each a warm-up
            for transport in (TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]):
                client.transport = http if transport == "http" else dist
                refit = measured_refit(vllm, policy, server.pid)
                if rep:
                    refits[transport].append(refit)
        generator = torch.Generator().manual_seed(0)  # on the CPU, as ActorState passes it
        runs = {"native": [], "vllm": []}
        for side in ("native", "vllm"):  # warm-up
            time_generation(native if side == "native" else vllm, ids, gen, generator)
        for rep in range(reps):
            for side in (("native", "vllm") if rep % 2 == 0 else ("vllm", "native")):
                runs[side].append(time_generation(native if side == "native" else vllm, ids, gen, generator))
        vllm.close()
    tps = {side: [r["tokens"] / r["seconds"] for r in rs] for side, rs in runs.items()}
    model_bytes = refits["http"][0]["bytes"]
    case = {"dtype": dtype, "prompts": len(ids), "max_new_tokens": gen.max_new_tokens, "server_ready_s": ready_s,
            "server_threads": rollout_env(vcfg).get("OMP_NUM_THREADS", "vLLM default"),
            "native_threads": torch.get_num_threads(),
            "native_tokens_per_s": stats(tps["native"]), "vllm_tokens_per_s": stats(tps["vllm"]),
            "native_tokens": stats([r["tokens"] for r in runs["native"]]),
            "vllm_tokens": stats([r["tokens"] for r in runs["vllm"]]),
            "speedup_vllm_over_native": stats(tps["vllm"])["median"] / stats(tps["native"])["median"],
            "refit_bytes": model_bytes,
            "refit": {transport: {"seconds": stats([r["total_s"] for r in rs]),
                                  "server_seconds": stats([r["seconds"] for r in rs]),
                                  "rank0_peak_extra_bytes": stats([r["rank0_peak_extra_bytes"] for r in rs]),
                                  "server_peak_extra_bytes": stats([r["server_peak_extra_bytes"] for r in rs]),
                                  "rank0_peak_extra_model_copies":
                                      max(r["rank0_peak_extra_bytes"] for r in rs) / model_bytes,
                                  "server_peak_extra_model_copies":
                                      max(r["server_peak_extra_bytes"] for r in rs) / model_bytes}
                      for transport, rs in refits.items()}}
    log(f"rollout {Path(model_dir).name} {dtype}: native {case['native_tokens_per_s']['median']:.0f} tok/s, vLLM "
        f"{case['vllm_tokens_per_s']['median']:.0f} tok/s (x{case['speedup_vllm_over_native']:.2f}); refit "
        + ", ".join(f"{t} {r['seconds']['median']:.2f}s (peak +{r['rank0_peak_extra_model_copies']:.2f} / "
                    f"+{r['server_peak_extra_model_copies']:.2f} model copies on rank 0 / the server)"
                    for t, r in case["refit"].items()))
    return case


def rloo_iteration(model_dir: str, reps: int) -> dict:
    """Whole RLOO iterations (8 prompts x 4 samples, 64-token responses, reward from the gold function, float32) with
    the native engine and vLLM over each weight transfer, alternating, after one warm-up iteration each."""
    sides = ("native",) + tuple(f"vllm-{t}" for t in TRANSPORTS)
    times, refit_share, refit_s, states, servers = {side: [] for side in sides}, {}, {}, {}, []
    try:
        for side in sides:
            cfg = tiny_config(algorithm="rloo", **{
                "model.policy": model_dir, "generation.max_new_tokens": 64, "rollout.engine": side.split("-")[0],
                "reinforce.rollout_batch_size": 8, "reward.source": "function", "deploy.rollout.port": 0,
                "reward.function": "models.tasks.sentiment:gold_reward"})
            actor = Leader(cfg, build_actor(cfg))
            if side != "native":
                server = launch_rollout(cfg, Path(tempfile.mkdtemp(prefix="rollout-bench-")) / "server.log")
                servers.append(server)
                server.wait_until_ready(cfg.deploy.rollout.ready_timeout_s)
                client = RolloutClient(server.url, RUN)
                if side.endswith("dist"):
                    client.use_dist("127.0.0.1")
                actor.state.engine.connect(client)
                actor.refit()
                refit_s[side], refit_share[side] = [], []
            states[side] = (actor, build_local_reward(cfg), prompt_batches(load_prompts(cfg), batch_size(cfg), 0))
        for rep in range(reps + 1):
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                actor, reward, batches = states[side]
                start = time.perf_counter()
                metrics, _ = actor.step(next(batches), None, reward)
                seconds = time.perf_counter() - start
                if rep == 0:
                    continue  # warm-up
                times[side].append({"seconds": seconds, "generate_s": metrics["time/generate"]})
                if side != "native":
                    refit_s[side].append(metrics["time/refit"])
                    refit_share[side].append(metrics["time/refit"] / metrics["step_time"])
    finally:
        for server in servers:
            server.stop()
    result = {"model": model_dir, "prompts": 8, "samples_per_prompt": 4, "max_new_tokens": 64, "dtype": "float32",
              **{f"{side}_seconds_per_iteration": stats([r["seconds"] for r in rs]) for side, rs in times.items()},
              **{f"{side}_generate_seconds": stats([r["generate_s"] for r in rs]) for side, rs in times.items()},
              **{f"{side}_refit_seconds": stats(v) for side, v in refit_s.items()},
              **{f"{side}_refit_share_of_iteration": stats(v) for side, v in refit_share.items()}}
    log("RLOO iteration (64-token responses): " + ", ".join(
        f"{side} {result[f'{side}_seconds_per_iteration']['median']:.2f}s" + (
            f" (refit {100 * result[f'{side}_refit_share_of_iteration']['median']:.1f}%)" if side != "native" else "")
        for side in sides))
    return result


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    reps = 2 if quick else 5
    cfg = tiny_config()
    prompts = load_prompts(cfg)[:32]
    tiny = cfg.local_path("model.policy")
    models = {}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-model-") as tmp:
        params = build_random_model(Path(tmp), tiny)
        models["qwen2_110m_random"] = {"parameters": params, "max_new_tokens": 64, "cases": [
            compare_generation(cfg, tmp, dtype, reps, prompts, 64) for dtype in ("float32", "bfloat16")]}
        iteration = rloo_iteration(tmp, reps)
    # the tiny policy has 64 positions: 16 new tokens (its default)
    models["tiny"] = {"parameters": sum(p.numel() for p in Policy.load(tiny).model.parameters()), "max_new_tokens": 16,
                      "cases": [compare_generation(cfg, tiny, dtype, reps, prompts, 16)
                                for dtype in ("float32", "bfloat16")]}
    result = {"quick": quick, "what": "rollout engines: native KV-cache loop vs the vLLM rollout server",
              "repetitions": {"reps_per_side_per_case": reps, "warmup_per_side": 1, "order": "alternating"},
              "models": models, "rloo_iteration_qwen2_110m_64_tokens": iteration}
    write_result("rollout_engine", result)
    return result


if __name__ == "__main__":
    main()
