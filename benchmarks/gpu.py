"""GPU: decode tokens/s against the weight-bandwidth roofline, training MFU and memory per setting, on a ~0.5B model
with random weights.

The model is built from a config (Qwen2-0.5B shape: 24 layers, hidden 896, GQA 14/2 heads, vocab 151,936, tied
embeddings; bfloat16), saved to a temporary directory and loaded back with the project's `Policy.load`, so nothing is
downloaded and the actor and its frozen reference sit where the library puts them. Decoding uses `Policy.generate`
(KV cache, sampling), with device-side sampling and with the CPU generator the actor state passes; the reference
forward is timed where `Policy.load` placed the reference; training uses `Policy.logprobs` + backward + AdamW (the
actor's inner loop).

- Decode roofline: every decode step reads all weights once (as stored: Policy.load keeps float32 master weights and
  computes under bf16 autocast) plus the KV cache so far, so
  tokens/s <= batch x bandwidth / (weight bytes + KV bytes). Bandwidth = measured device-to-device copy bandwidth
  (reported with the nominal figure when the GPU is known).
- MFU = model FLOPs / s / peak dense bf16 FLOPs, with model FLOPs = 6 x matmul params x tokens + attention
  (12 x layers x hidden x sequence per token, causal halves it: 6 x ...).
- Memory (benchmarks/memory.py): one training step of the same model with each setting of model.dtype (float32,
  bfloat16) x model.gradient_checkpointing, each in a process of its own: peak allocated memory, static memory
  (weights, reference, AdamW states), activation bytes saved for backward, seconds per step; a setting that runs out
  of memory is recorded as such. Written to be run where a GPU is lent (none was when it was written).
- vLLM: the rollout server (rollout.engine=vllm) against the native engine on the same model, bf16, batches of 16, 64
  and 256 prompts x 256 new tokens, and its refit time (benchmarks/rollout_engine.compare_generation); skipped, with
  the reason recorded, where the server's environment is missing.

Without CUDA the result records "skipped: no CUDA device". `--cpu-smoke` runs the same code on a tiny config on the
CPU (checks the script; its numbers are meaningless and are written to results/tmp/).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.common import RESULTS, log, stats, tiny_config, write_result
from benchmarks.async_rollouts import throughput as async_throughput
from benchmarks.memory import measure as measure_memory
from benchmarks.rollout_engine import compare_generation
from components.serving.launcher import rollout_python
from models.config import OptimConfig, Sampling
from models.loading import make_optimizer
from models.loop import load_prompts
from models.policy import Policy
from models.engines import NativeEngine
from models.tiny import build_tokenizer

# name fragment -> (peak dense bf16 FLOP/s, nominal memory bandwidth B/s)
KNOWN_GPUS = {
    "H200": (989e12, 4.8e12), "H100 SXM": (989e12, 3.35e12), "H100 80GB HBM3": (989e12, 3.35e12),
    "H100 PCIe": (756e12, 2.0e12), "H100 NVL": (835e12, 3.9e12), "A100-SXM4-80GB": (312e12, 2.04e12),
    "A100-SXM4-40GB": (312e12, 1.56e12), "A100 80GB PCIe": (312e12, 1.94e12), "A100-PCIE-40GB": (312e12, 1.56e12),
    "L40S": (362e12, 0.864e12), "L4": (121e12, 0.3e12), "A10G": (125e12, 0.6e12),
}


def known_gpu(name: str):
    for fragment, spec in KNOWN_GPUS.items():
        if fragment.lower() in name.lower():
            return fragment, spec
    return None, (None, None)


def model_config(smoke: bool):
    if smoke:  # head size 32: vLLM's CPU attention needs >= 32
        return Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           tie_word_embeddings=True)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, gib: float) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 5."""
    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * n * 4 / best


def matmul_params(cfg) -> int:
    """Parameters that take part in matmuls per token: all layers + the LM head (embedding lookup excluded)."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o, k, v, gate/up/down
    return L * per_layer + cfg.vocab_size * h


def decode_bench(policy, cfg, device, batches, prompt_len, new_tokens, reps, weight_bytes, bandwidth):
    gen = Sampling(max_new_tokens=new_tokens, temperature=1.0)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16
    out, engine = [], NativeEngine.for_policy(policy)
    for batch in batches:
        prompts = torch.randint(2, cfg.vocab_size, (batch, prompt_len)).tolist()
        for label, generator in (("device sampling (generator=None)", None),
                                 ("CPU generator (as ActorState passes)", torch.Generator().manual_seed(0))):
            engine.generate(prompts, 1, Sampling(max_new_tokens=4), generator)  # warm-up
            rates = []
            for _ in range(reps):
                sync(device)
                start = time.perf_counter()
                rollout = engine.generate(prompts, 1, gen, generator)
                sync(device)
                rates.append(int(rollout.response_lengths.sum()) / (time.perf_counter() - start))
            avg_context = prompt_len + new_tokens / 2
            roofline = batch * bandwidth / (weight_bytes + batch * avg_context * kv_bytes_per_token)
            s = stats(rates)
            out.append({"batch": batch, "sampling": label, "prompt_len": prompt_len, "new_tokens": new_tokens,
                        "tokens_per_s": s, "roofline_tokens_per_s": roofline,
                        "fraction_of_roofline": s["median"] / roofline})
            log(f"gpu decode B={batch} {label}: {s['median']:.0f} tok/s = {s['median'] / roofline:.0%} of roofline")
    return out


def reference_bench(policy, cfg, device, batch, seq_len, reps):
    """Reference logprobs where Policy.load puts the reference vs the same forward with the actor on the device."""
    tokens = torch.randint(2, cfg.vocab_size, (batch, seq_len), device=device)
    lengths = torch.full((batch,), seq_len, device=device)
    out = {"batch": batch, "seq_len": seq_len,
           "reference_device": (str(next(policy.reference.parameters()).device) if policy.reference is not None
                                else None)}
    for label, kwargs in (("reference (as loaded)", {"reference": True}), ("actor on device, no grad", {})):
        times = []
        for rep in range(reps + 1):
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                policy.logprobs(tokens, lengths, 1.0, **kwargs)
            sync(device)
            if rep:
                times.append(time.perf_counter() - start)
        out[label] = stats(times)
        log(f"gpu logprobs B={batch} L={seq_len} {label}: {out[label]['median'] * 1e3:.0f} ms")
    return out


def train_bench(policy, cfg, device, batch, seq_len, reps, peak_flops):
    optimizer, _ = make_optimizer(policy.trainable_parameters(), OptimConfig(lr=1e-6))
    tokens = torch.randint(2, cfg.vocab_size, (batch, seq_len), device=device)
    lengths = torch.full((batch,), seq_len, device=device)
    policy.model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        logp, _ = policy.logprobs(tokens, lengths, 1.0, with_entropy=False)
        (-logp.mean()).backward()
        optimizer.step()

    step()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    n = matmul_params(cfg)
    flops = 6 * n * batch * seq_len + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq_len * batch * seq_len
    s = stats(times)
    achieved = flops / s["median"]
    result = {"batch": batch, "seq_len": seq_len, "seconds_per_step": s, "model_flops_per_step": flops,
              "achieved_tflops": achieved / 1e12, "mfu": achieved / peak_flops if peak_flops else None}
    log(f"gpu train B={batch} L={seq_len}: {s['median'] * 1e3:.0f} ms/step, {achieved / 1e12:.1f} TFLOP/s"
        + (f", MFU {achieved / peak_flops:.0%}" if peak_flops else ""))
    return result


def memory_bench(model_dir: str, device, smoke: bool, reps: int) -> list[dict]:
    """model.dtype x model.gradient_checkpointing on one training step (benchmarks/memory.py), at a short and a long
    sequence: where float32 without checkpointing runs out of memory, the settings that fit show what they buy."""
    shapes = [(2, 32)] if smoke else [(4, 1024), (8, 2048)]
    return [row for batch, seq_len in shapes for row in measure_memory(model_dir, batch, seq_len, reps, device.type)]


def vllm_bench(model_dir: str, device, smoke: bool, reps: int) -> dict:
    """The vLLM rollout server (rollout.engine=vllm, its own process, bf16, 30% of the GPU's memory) against the
    native engine on the same model and prompts (benchmarks/rollout_engine.compare_generation): tokens/s and refit
    seconds. Needs the server's environment (`VLLM_PACKAGE=vllm make vllm-venv` on a GPU host)."""
    cfg = tiny_config()
    try:
        rollout_python(cfg)
    except FileNotFoundError as exc:
        log(f"gpu vLLM: skipped ({exc})")
        return {"skipped": str(exc)}
    prompts = load_prompts(cfg)
    cases = []
    for batch in ([4] if smoke else [16, 64, 256]):
        case = compare_generation(cfg, model_dir, "bfloat16", reps, (prompts * batch)[:batch], 8 if smoke else 256,
                                  device=str(device))
        cases.append({"batch": batch, **case})
        log(f"gpu vLLM B={batch}: {case['vllm_tokens_per_s']['median']:.0f} tok/s vs native "
            f"{case['native_tokens_per_s']['median']:.0f} (x{case['speedup_vllm_over_native']:.2f}), refit "
            + ", ".join(f"{t} {r['seconds']['median']:.2f}s" for t, r in case["refit"].items()))
    return {"dtype": "bfloat16", "gpu_memory_utilization": cfg.deploy.rollout.gpu_memory_utilization, "cases": cases}


def async_bench(model_dir: str, smoke: bool) -> dict:
    """Asynchronous rollouts (benchmarks/async_rollouts.py) on the GPU: RLOO with k = 0 and 1, the actor and the vLLM
    server sharing the one GPU (30% of its memory for the server); iterations per minute, rollout wait, engine idle."""
    cfg = tiny_config()
    try:
        rollout_python(cfg)
    except FileNotFoundError as exc:
        return {"skipped": str(exc)}
    sizes = {"generation.max_new_tokens": 16 if smoke else 512, "reinforce.rollout_batch_size": 4 if smoke else 64,
             "reinforce.minibatch_size": 8 if smoke else 64, "generation.micro_batch_size": 8 if smoke else 16,
             "rollout.vllm.dtype": "bfloat16", "model.dtype": "bfloat16"}
    with tempfile.TemporaryDirectory(prefix="gpu-async-") as tmp:
        return async_throughput(model_dir, 4 if smoke else 10, dict(os.environ, HF_HUB_OFFLINE="1"), Path(tmp),
                                runs=[("k0", 0, None), ("k1", 1, None)], sizes=sizes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny config on CPU: checks the script only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        log("gpu: skipped (no CUDA device)")
        result = {"quick": args.quick, "skipped": "no CUDA device",
                  "what": "decode tokens/s vs roofline, training MFU, memory per model.dtype x "
                          "model.gradient_checkpointing (~0.5B model)"}
        write_result("gpu", result)
        return result

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    cfg = model_config(args.cpu_smoke)
    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory(prefix="gpu-bench-")
    # saved and loaded back through Policy.load, so the actor and its reference sit where the library puts them
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp.name)
    build_tokenizer().save_pretrained(tmp.name)
    policy = Policy.load(tmp.name, dtype="bfloat16", device=device)
    model = policy.model
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_dtype = str(next(model.parameters()).dtype)
    log(f"gpu: {params / 1e6:.1f}M-parameter {cfg.model_type} (random weights stored {weight_dtype}, compute "
        f"{policy.dtype}) on {device}")

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)"
    matched, (peak_flops, nominal_bw) = known_gpu(name)
    bandwidth = copy_bandwidth(device, 0.01 if args.cpu_smoke else 2.0)
    reps = 2 if (args.quick or args.cpu_smoke) else 5
    small = args.cpu_smoke
    decode = decode_bench(policy, cfg, device, [1, 4] if small else [1, 16, 64, 256], 16 if small else 128,
                          8 if small else 256, reps, weight_bytes, bandwidth)
    reference = reference_bench(policy, cfg, device, 4 if small else 8, 32 if small else 256, 2)  # CPU: slow
    train = [train_bench(policy, cfg, device, b, L, reps, peak_flops)
             for b, L in ([(2, 32)] if small else [(8, 512), (16, 512)])]
    compute_dtype = policy.dtype
    del policy, model  # the GPU's memory goes to the vLLM server (and the native side it is compared with)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with tmp:
        memory = memory_bench(tmp.name, device, small, reps)
        vllm = vllm_bench(tmp.name, device, small, reps)
        asynchronous = async_bench(tmp.name, small)
    result = {
        "quick": args.quick,
        "what": "decode tokens/s vs weight-bandwidth roofline, training MFU, memory per model.dtype x "
                "model.gradient_checkpointing (~0.5B model, random weights)",
        "device": name, "known_gpu_entry": matched, "peak_bf16_flops": peak_flops,
        "nominal_bandwidth_bytes_per_s": nominal_bw, "measured_copy_bandwidth_bytes_per_s": bandwidth,
        "model": {"config": cfg.to_dict(), "parameters": params, "weight_bytes": weight_bytes,
                  "weight_dtype": weight_dtype, "compute_dtype": compute_dtype,
                  "matmul_parameters": matmul_params(cfg)},
        "repetitions": {"reps": reps, "warmup": 1},
        "decode": decode, "reference_logprobs": reference, "train": train, "memory": memory,
        "vllm_rollout_server": vllm,
        "async_rollouts": asynchronous,
        "notes": ["roofline uses the measured copy bandwidth and the weights as Policy.load stores them (float32 "
                  "master weights, bf16 autocast compute: each step reads the float32 weights); tokens/s counts every "
                  "generated token",
                  "Policy.logprobs computes full-vocabulary float32 log-softmax: its memory traffic is part of the "
                  "measured step"],
    }
    if args.cpu_smoke:
        path = RESULTS / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        (path / "gpu-cpu-smoke.json").write_text(__import__("json").dumps(result, indent=2, default=str))
        log(f"gpu: cpu smoke written to {path / 'gpu-cpu-smoke.json'} (not a result)")
        return result
    write_result("gpu", result)
    return result


if __name__ == "__main__":
    main()
