"""Rollout engines side by side: the native KV-cache loop (on the actor's module) against the vLLM rollout server.

Models: the tiny policy, and a ~110M Qwen2-shaped model built from config with random weights (saved with
save_pretrained, loaded by both sides through from_pretrained, as a user's model would be). For each model and dtype
(float32, bfloat16):
- generation tokens/s: the same prompt token ids (32 prompts), 64 new tokens at temperature 1, alternating sides;
  the vLLM side's time is the whole HTTP round trip from rank 0 (request, sampling, answer, unpacking).
- refit seconds: gather the state dict, pack it as safetensors, send it, reload it in vLLM, clear the prefix cache.
And the whole RLOO iteration (rollout_batch_size 8 prompts x k 4, 64-token responses, reward from a function) on the
tiny policy with each engine, alternating, with the share of the iteration the refit takes.

Both sides get every core, as in a run: the native side torch's default, the server its default on a CPU host
(rollout.vllm.threads; the actor waits while the server generates). On a GPU, the server takes 30% of the GPU memory
(rollout.vllm.gpu_memory_utilization).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from benchmarks.common import log, quick_flag, stats, tiny_config, write_result
from components.serving.rollout import RolloutServer, server_env
from models.loop import Leader, batch_size, build_actor, build_local_reward, load_prompts, prompt_batches
from models.config import merge
from models.policy import Policy
from models.rollout import NativeEngine, VLLMEngine
from models.rollout.vllm import RolloutClient


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
    rollout = engine.generate(prompt_ids, gen, generator)
    if rollout.tokens.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int(rollout.response_lengths.sum())}


def compare_generation(cfg, model_dir: str, dtype: str, reps: int, prompts: list[str], new_tokens: int,
                       device: str = "cpu") -> dict:
    """Native engine (on `device`) against the vLLM server (its own process, GPU when there is one) on `model_dir`:
    tokens/s over alternating repetitions after a warm-up each, and the refit time."""
    policy = Policy.load(model_dir, dtype=dtype, device=device)
    ids = policy.encode_prompts(prompts)
    gen = cfg.generation.model_copy(update={"max_new_tokens": new_tokens, "temperature": 1.0})
    native = NativeEngine.for_policy(policy)
    vcfg = merge(cfg, {"model.policy": model_dir, "rollout.vllm.dtype": dtype})
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as logs, RolloutServer(vcfg, Path(logs) / "server.log") as server:
        started = time.perf_counter()
        server.wait_until_ready(vcfg.rollout.vllm.ready_timeout_s)
        ready_s = time.perf_counter() - started
        vllm = VLLMEngine(policy.pad_id, policy.stop_ids, weights_dtype=dtype)
        vllm.connect(RolloutClient(server.url))
        refits = []
        for _ in range(max(2, reps // 2)):
            vllm.update_weights(policy.engine_weights())
            refits.append(vllm.last_refit)
        generator = torch.Generator().manual_seed(0)  # on the CPU, as ActorState passes it
        runs = {"native": [], "vllm": []}
        for side in ("native", "vllm"):  # warm-up
            time_generation(native if side == "native" else vllm, ids, gen, generator)
        for rep in range(reps):
            for side in (("native", "vllm") if rep % 2 == 0 else ("vllm", "native")):
                runs[side].append(time_generation(native if side == "native" else vllm, ids, gen, generator))
        vllm.close()
    tps = {side: [r["tokens"] / r["seconds"] for r in rs] for side, rs in runs.items()}
    case = {"dtype": dtype, "prompts": len(ids), "max_new_tokens": gen.max_new_tokens, "server_ready_s": ready_s,
            "server_threads": server_env(vcfg).get("OMP_NUM_THREADS", "vLLM default"),
            "native_threads": torch.get_num_threads(),
            "native_tokens_per_s": stats(tps["native"]), "vllm_tokens_per_s": stats(tps["vllm"]),
            "native_tokens": stats([r["tokens"] for r in runs["native"]]),
            "vllm_tokens": stats([r["tokens"] for r in runs["vllm"]]),
            "speedup_vllm_over_native": stats(tps["vllm"])["median"] / stats(tps["native"])["median"],
            "refit_s": stats([r["total_s"] for r in refits]),
            "refit_gather_pack_s": stats([r["gather_pack_s"] for r in refits]),
            "refit_server_s": stats([r["server_s"] for r in refits]), "refit_bytes": refits[0]["bytes"]}
    log(f"rollout {Path(model_dir).name} {dtype}: native {case['native_tokens_per_s']['median']:.0f} tok/s, vLLM "
        f"{case['vllm_tokens_per_s']['median']:.0f} tok/s (x{case['speedup_vllm_over_native']:.2f}), refit "
        f"{case['refit_s']['median']:.2f}s")
    return case


def rloo_iteration(model_dir: str, reps: int) -> dict:
    """Whole RLOO iterations (8 prompts x 4 samples, 64-token responses, reward from the gold function, float32) with
    each engine, alternating, after one warm-up iteration each."""
    times, refit_share, refit_s, states, servers = {"native": [], "vllm": []}, [], [], {}, []
    try:
        for engine in ("native", "vllm"):
            cfg = tiny_config(algorithm="rloo", **{
                "model.policy": model_dir, "generation.max_new_tokens": 64, "rollout.engine": engine,
                "reinforce.rollout_batch_size": 8, "reward.source": "function",
                "reward.function": "models.tasks.sentiment:gold_reward"})
            actor = Leader(cfg, build_actor(cfg))
            if engine == "vllm":
                server = RolloutServer(cfg, Path(tempfile.mkdtemp(prefix="rollout-bench-")) / "server.log")
                servers.append(server)
                server.wait_until_ready(cfg.rollout.vllm.ready_timeout_s)
                actor.state.engine.connect(RolloutClient(server.url))
                actor.refit()
            states[engine] = (actor, build_local_reward(cfg), prompt_batches(load_prompts(cfg), batch_size(cfg), 0))
        for rep in range(reps + 1):
            for engine in (("native", "vllm") if rep % 2 == 0 else ("vllm", "native")):
                actor, reward, batches = states[engine]
                start = time.perf_counter()
                metrics, _ = actor.step(next(batches), None, reward)
                seconds = time.perf_counter() - start
                if rep == 0:
                    continue  # warm-up
                times[engine].append({"seconds": seconds, "generate_s": metrics["time/generate"]})
                if engine == "vllm":
                    refit_s.append(metrics["time/refit"])
                    refit_share.append(metrics["time/refit"] / metrics["time/step"])
    finally:
        for server in servers:
            server.stop()
    result = {"model": model_dir, "prompts": 8, "samples_per_prompt": 4, "max_new_tokens": 64, "dtype": "float32",
              **{f"{side}_seconds_per_iteration": stats([r["seconds"] for r in rs]) for side, rs in times.items()},
              **{f"{side}_generate_seconds": stats([r["generate_s"] for r in rs]) for side, rs in times.items()},
              "refit_seconds": stats(refit_s), "refit_share_of_iteration": stats(refit_share)}
    result["time_ratio_vllm_over_native"] = (result["vllm_seconds_per_iteration"]["median"]
                                             / result["native_seconds_per_iteration"]["median"])
    log(f"RLOO iteration (64-token responses): native {result['native_seconds_per_iteration']['median']:.2f}s, vLLM "
        f"{result['vllm_seconds_per_iteration']['median']:.2f}s, refit {100 * result['refit_share_of_iteration']['median']:.1f}% of it")
    return result


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    reps = 2 if quick else 5
    cfg = tiny_config()
    prompts = load_prompts(cfg)[:32]
    tiny = str(cfg.resolve_model_path(cfg.model.policy))
    models = {}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-model-") as tmp:
        params = build_random_model(Path(tmp), tiny)
        models["qwen2_110m_random"] = {"parameters": params, "max_new_tokens": 64, "cases": [
            compare_generation(cfg, tmp, dtype, reps, prompts, 64) for dtype in ("float32", "bfloat16")]}
        iteration = rloo_iteration(tmp, reps)
    # the tiny policy has 64 positions: 16 new tokens (its default)
    models["tiny"] = {"parameters": sum(p.numel() for p in Policy.load(tiny).model.parameters()), "max_new_tokens": 16,
                      "cases": [compare_generation(cfg, tiny, dtype, reps, prompts, 16) for dtype in ("float32", "bfloat16")]}
    result = {"quick": quick, "what": "rollout engines: native KV-cache loop vs the vLLM rollout server",
              "repetitions": {"reps_per_side_per_case": reps, "warmup_per_side": 1, "order": "alternating"},
              "models": models, "rloo_iteration_qwen2_110m_64_tokens": iteration}
    write_result("rollout_engine", result)
    return result


if __name__ == "__main__":
    main()
