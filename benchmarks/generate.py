"""Rollout throughput: models.policy.Policy.generate vs a plain Hugging Face `model.generate` baseline.

Same tiny policy, same prompt token ids, batch, max_new_tokens and sampling (do_sample, temperature, no top-k/top-p),
KV cache on, prompts left-padded, both stop when every row has produced EOS. Generated tokens = response tokens up to
and including the first EOS. Left-padding the prompt ids is inside the timed region for both. Reps alternate A/B.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import log, quick_flag, stats, tiny_config, write_result
from models.loop import load_prompts
from models.policy import Policy
from models.config import Sampling
from models.engines import NativeEngine
from models.engines.native import left_pad


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float) -> int:
    """The baseline: left-pad, `model.generate(do_sample=True, use_cache=True)`; returns generated tokens."""
    input_ids, attention = left_pad(prompt_ids, tokenizer.pad_token_id)
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, use_cache=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return response_tokens(out[:, input_ids.shape[1]:], tokenizer.eos_token_id)


def response_tokens(new: torch.Tensor, eos_id: int) -> int:
    is_eos = new == eos_id
    ended = is_eos.any(1)
    lengths = torch.where(ended, is_eos.float().argmax(1) + 1, torch.full_like(ended, new.shape[1], dtype=torch.long))
    return int(lengths.sum())


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    reps = 3 if quick else 15
    cfg = tiny_config()
    policy = Policy.load(cfg.local_path("model.policy"))
    model, tokenizer, gen = policy.model, policy.tokenizer, cfg.generation
    engine = NativeEngine.for_policy(policy)
    prompts = load_prompts(cfg)
    cases = [(cfg.ppo.rollout_batch_size, gen.max_new_tokens), (256, gen.max_new_tokens), (64, 48)]
    limit = model.config.n_positions if hasattr(model.config, "n_positions") else 10**9
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    results = []
    for batch, new_tokens in cases:
        ids = policy.encode_prompts([prompts[i % len(prompts)] for i in range(batch)])
        if max(map(len, ids)) + new_tokens > limit:
            continue
        g = Sampling.of(gen, max_new_tokens=new_tokens)
        ours, hf = [], []
        # warm-up both paths once
        engine.generate(ids, 1, g, generator)
        hf_generate(model, tokenizer, ids, new_tokens, gen.temperature)
        for rep in range(reps):
            for side in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
                start = time.perf_counter()
                if side == "ours":
                    tokens = int(engine.generate(ids, 1, g, generator).response_lengths.sum())
                else:
                    with torch.no_grad():
                        tokens = hf_generate(model, tokenizer, ids, new_tokens, gen.temperature)
                seconds = time.perf_counter() - start
                (ours if side == "ours" else hf).append({"seconds": seconds, "tokens": tokens})
        ours_tps = [r["tokens"] / r["seconds"] for r in ours]
        hf_tps = [r["tokens"] / r["seconds"] for r in hf]
        case = {"batch": batch, "max_new_tokens": new_tokens, "temperature": gen.temperature, "top_k": 0, "top_p": 1.0,
                "ours_tokens_per_s": stats(ours_tps), "hf_tokens_per_s": stats(hf_tps),
                "ours_seconds": stats([r["seconds"] for r in ours]), "hf_seconds": stats([r["seconds"] for r in hf]),
                "ours_tokens": stats([r["tokens"] for r in ours]), "hf_tokens": stats([r["tokens"] for r in hf]),
                "speedup_tokens_per_s": stats(ours_tps)["median"] / stats(hf_tps)["median"]}
        log(f"generate B={batch} new={new_tokens}: ours {case['ours_tokens_per_s']['median']:.0f} tok/s, "
            f"HF {case['hf_tokens_per_s']['median']:.0f} tok/s (x{case['speedup_tokens_per_s']:.2f})")
        results.append(case)
    result = {"quick": quick, "what": "rollout tokens/s, Policy.generate vs HF model.generate (KV cache, sampling)",
              "repetitions": {"reps_per_side_per_case": reps, "warmup_per_side": 1, "order": "alternating"},
              "model": {"path": cfg.model.policy, "parameters": sum(p.numel() for p in model.parameters())},
              "cases": results}
    write_result("generate", result)
    return result


if __name__ == "__main__":
    main()
