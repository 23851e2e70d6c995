"""Memory settings side by side (docs/memory.md): what one actor training step takes in memory and time with each
setting of `model.dtype` x `model.gradient_checkpointing`, on a model built from a config with random weights.

Each setting runs in a process of its own, so each peak is its own: the model is saved once, loaded with the
project's `Policy.load` (float32 master weights, the frozen reference where the library puts it, the setting's
compute dtype and checkpointing), then `reps` training steps after a warm-up (`Policy.logprobs` over B x L tokens,
backward, fused AdamW step), as the actor's inner loop does. Recorded per setting:

- peak memory: CUDA `torch.cuda.max_memory_allocated` (and reserved); CPU the process's peak RSS (`ru_maxrss`),
- static memory after a step with the gradients freed (weights, reference, AdamW states), so peak - static is what
  the step itself adds (activations, gradients, logits),
- the bytes autograd saved for the backward pass (`saved_tensors_hooks`): the activation memory, measured alike on
  any device, the quantity checkpointing lowers,
- seconds per step (median of `reps`).

    python -m benchmarks.memory           # CPU: a ~110M Qwen2-shaped model, 4 x 256 tokens -> results/memory.json
    python -m benchmarks.memory --quick   # fewer repetitions, results/tmp/quick/
    python -m benchmarks.gpu              # the same comparison on the ~0.5B model where CUDA exists (gpu.json)

LoRA's frozen base (`--lora`): the same step with LoRA adapters (r=16 on the attention projections) and
model.dtype=bfloat16, with this checkout's code (the base held in bf16, the adapters in float32) and, side by side in
the same run, with the code of another checkout (`--baseline DIR`, e.g. a worktree of main before the change, whose
base stayed float32): the bytes of the frozen and the trainable parameters, static and peak RSS, s/step.

    python -m benchmarks.memory --lora --baseline /work/main   # -> results/memory_lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from benchmarks.common import ROOT, log, stats, write_result
from models.config import LoraConfig, OptimConfig
from models.loading import make_optimizer
from models.policy import Policy
from models.tiny_files import embedded_model_path

SETTINGS = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))
LORA = {"enabled": True, "r": 16, "alpha": 32.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def qwen2_110m() -> Qwen2Config:
    return Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def save_random_model(config, directory: str | Path) -> int:
    """A model of `config` with random weights (seed 0) and the embedded tiny tokenizer, saved for from_pretrained."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_path("tiny/policy")))
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_setting(model_dir: str, dtype: str, checkpointing: bool, batch: int, seq_len: int, reps: int,
                device: torch.device, lora: bool = False) -> dict:
    """One setting in this process: peak and static memory, saved activation bytes, seconds per step; with `lora`,
    LoRA adapters (LORA) and the bytes of the frozen and the trainable parameters."""
    policy = Policy.load(model_dir, LoraConfig(**LORA) if lora else None, dtype=dtype, device=device,
                         gradient_checkpointing=checkpointing)
    frozen = [p for p in policy.model.parameters() if not p.requires_grad]
    params = {"frozen_bytes": sum(p.numel() * p.element_size() for p in frozen),
              "trainable_bytes": sum(p.numel() * p.element_size() for p in policy.trainable_parameters()),
              "frozen_dtypes": sorted({str(p.dtype) for p in frozen})}
    optimizer, _ = make_optimizer(policy.trainable_parameters(), OptimConfig(lr=1e-6))
    vocab = policy.model.config.vocab_size
    tokens = torch.randint(2, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    lengths = torch.full((batch,), seq_len, device=device)
    policy.model.train()
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    def step(count_saved: bool = False) -> None:
        optimizer.zero_grad(set_to_none=True)
        if count_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logp, _ = policy.logprobs(tokens, lengths)
        else:
            logp, _ = policy.logprobs(tokens, lengths)
        (-logp.mean()).backward()
        optimizer.step()

    step(count_saved=True)  # warm-up: AdamW states exist from here on
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    out = {"dtype": dtype, "gradient_checkpointing": checkpointing, "batch": batch, "seq_len": seq_len,
           "saved_for_backward_bytes": saved, **({"lora": LORA, **params} if lora else {})}
    if device.type == "cuda":
        out["static_bytes"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        out["static_rss_bytes"] = _rss_bytes()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    out["seconds_per_step"] = stats(times)
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model_dir: str, batch: int, seq_len: int, reps: int, device: str) -> list[dict]:
    """Every setting in a child process of its own (its own peak); a setting that runs out of memory is recorded
    as such."""
    rows = []
    for dtype, checkpointing in SETTINGS:
        command = [sys.executable, "-m", "benchmarks.memory", "--one", model_dir, dtype, str(int(checkpointing)),
                   str(batch), str(seq_len), str(reps), device]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
            row = {"dtype": dtype, "gradient_checkpointing": checkpointing, "batch": batch, "seq_len": seq_len,
                   "failed": reason, "out_of_memory": "OutOfMemoryError" in proc.stderr}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        log("memory " + describe(row))
    return rows


def measure_lora(model_dir: str, batch: int, seq_len: int, reps: int, code: dict[str, str | None]) -> list[dict]:
    """The LoRA setting (model.dtype=bfloat16) in a child process per checkout: `code` maps a label to the directory
    whose models/ the child imports (None: this checkout); the child runs this file by its path, so the measuring
    code is the same for every checkout."""
    rows = []
    for label, directory in code.items():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (directory or str(ROOT), str(ROOT)) if p))
        command = [sys.executable, str(Path(__file__).resolve()), "--one-lora", model_dir, str(batch), str(seq_len),
                   str(reps)]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=directory or ROOT, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{label}: {proc.stderr.strip()[-2000:]}")
        row = {"code": label, "directory": directory or str(ROOT), **json.loads(proc.stdout.strip().splitlines()[-1])}
        rows.append(row)
        log(f"memory lora ({label}): frozen base {row['frozen_bytes'] / 2**20:.0f} MiB {row['frozen_dtypes']}, "
            f"adapters {row['trainable_bytes'] / 2**20:.1f} MiB, " + describe(row))
    return rows


def describe(row: dict) -> str:
    label = (f"{row['dtype']}{' + checkpointing' if row['gradient_checkpointing'] else ''} "
             f"B={row['batch']} L={row['seq_len']}")
    if "failed" in row:
        return f"{label}: failed ({row['failed']})"
    peak = row.get("peak_bytes", row.get("peak_rss_bytes"))
    return (f"{label}: peak {peak / 2**30:.2f} GiB, saved for backward {row['saved_for_backward_bytes'] / 2**20:.0f} "
            f"MiB, {row['seconds_per_step']['median']:.2f} s/step")


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; results to results/tmp/quick/")
    parser.add_argument("--one", nargs=7, metavar=("MODEL", "DTYPE", "CKPT", "B", "L", "REPS", "DEVICE"),
                        help="(internal) measure one setting in this process and print it as JSON")
    parser.add_argument("--lora", action="store_true", help="LoRA with model.dtype=bfloat16 (results/memory_lora.json)")
    parser.add_argument("--baseline", help="with --lora: also measure the code of this checkout (e.g. main's worktree)")
    parser.add_argument("--one-lora", nargs=4, metavar=("MODEL", "B", "L", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_lora:
        model_dir, batch, seq_len, reps = args.one_lora
        print(json.dumps(one_setting(model_dir, "bfloat16", False, int(batch), int(seq_len), int(reps),
                                     torch.device("cpu"), lora=True)))
        return None
    if args.lora:
        return lora_main(args)
    if args.one:
        model_dir, dtype, checkpointing, batch, seq_len, reps, device = args.one
        row = one_setting(model_dir, dtype, checkpointing == "1", int(batch), int(seq_len), int(reps),
                          torch.device(device))
        print(json.dumps(row))
        return None
    return run_benchmark(
        "memory", args.quick, "every setting of model.dtype x model.gradient_checkpointing",
        lambda model_dir, batch, seq_len, reps: measure(model_dir, batch, seq_len, reps, "cpu"),
        "one actor training step per setting of model.dtype x model.gradient_checkpointing: peak RSS, activation bytes "
        "saved for backward, s/step",
        ["CPU peak RSS includes the interpreter and libraries (~0.5-1 GiB) and the float32 weights, AdamW states and "
         "frozen reference; saved_for_backward_bytes is the activation memory alone",
         "bf16 on this CPU is autocast: its matmuls cast the float32 weights at every use"])


def lora_main(args) -> dict:
    code = {"this checkout": None, **({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})}
    return run_benchmark(
        "memory_lora", args.quick, f"LoRA r={LORA['r']} on {LORA['target_modules']}, model.dtype=bfloat16",
        lambda model_dir, batch, seq_len, reps: measure_lora(model_dir, batch, seq_len, reps, code),
        "one LoRA actor training step with model.dtype=bfloat16, per checkout of the code: the bytes of the frozen "
        "base and of the adapters, peak RSS, activation bytes saved for backward, s/step",
        ["frozen_bytes/trainable_bytes are exact (parameter storage); RSS also holds the interpreter, the libraries "
         "and what the allocator kept"])


def run_benchmark(name: str, quick: bool, settings: str, rows_of, what: str, notes: list[str]) -> dict:
    """Save the ~110M model, measure its rows (`rows_of(model_dir, batch, seq_len, reps)`), write results/<name>."""
    batch, seq_len, reps = 4, 256, 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        params = save_random_model(qwen2_110m(), tmp)
        log(f"{name}: {params / 1e6:.0f}M-parameter Qwen2-shaped model, random weights, {settings}, CPU, "
            f"{batch} x {seq_len} tokens")
        rows = rows_of(tmp, batch, seq_len, reps)
    result = {"quick": quick, "device": "cpu", "what": what,
              "model": {"config": qwen2_110m().to_dict(), "parameters": params},
              "repetitions": {"reps": reps, "warmup": 1, "process_per_setting": True}, "settings": rows, "notes": notes}
    write_result(name, result)
    return result


if __name__ == "__main__":
    main()
