"""`rlhf models tiny`: build, offline and from a seed, a tiny policy, reward model and critic for the shipped task.

The policy is a GPT-2-style causal LM briefly pretrained on the task's synthetic review corpus (so it writes
grammatical, sentiment-balanced reviews and ends them with EOS); the reward model is trained to regress the gold
reward; the critic is initialised from the reward model. Everything is written with `save_pretrained`, and is loaded
back through the same `from_pretrained` code a user's real checkpoint takes.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

from models.critic import init_critic
from models.tasks import sentiment

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + sentiment.vocabulary())}
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="right")


def tiny_config(tokenizer, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, **kw) -> GPT2Config:
    return GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)


def _batches(rows: list[list[int]], targets: list[float] | None, batch: int, rng: random.Random, pad: int):
    order = list(range(len(rows)))
    rng.shuffle(order)
    for s in range(0, len(order) - batch + 1, batch):
        idx = order[s:s + batch]
        L = max(len(rows[i]) for i in idx)
        ids = torch.full((batch, L), pad, dtype=torch.long)
        mask = torch.zeros((batch, L), dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, :len(rows[i])] = torch.tensor(rows[i])
            mask[j, :len(rows[i])] = 1
        yield ids, mask, (torch.tensor([targets[i] for i in idx]) if targets is not None else None)


def _reward_texts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Reward-model training pairs: the corpus, plus word salads and sentiment-heavy drifts a policy may produce."""
    pairs = sentiment.corpus(n // 2, seed=rng.randrange(10**6))
    words = sentiment.vocabulary()
    for _ in range(n - len(pairs)):
        noun = rng.choice(sentiment.NOUNS)
        prompt = rng.choice(sentiment.PROMPT_TEMPLATES).format(n=noun)
        if rng.random() < 0.5:
            response = " ".join(rng.choice(words) for _ in range(rng.randint(1, 14)))
        else:
            pool = rng.choice([sentiment.POSITIVE, sentiment.NEGATIVE, sentiment.POSITIVE + sentiment.NEGATIVE])
            response = " ".join(rng.choice(pool + ["the", noun, "is", "and", "very"]) for _ in range(rng.randint(1, 14)))
        pairs.append((prompt, response + (" ." if rng.random() < 0.7 else "")))
    return pairs


def build_tiny(out: str | Path, seed: int = 0, policy_steps: int = 600, reward_steps: int = 600, log=print) -> dict:
    """Build tokenizer + policy + reward + critic under `out`; returns their paths and final training losses."""
    out = Path(out)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = time.time()
    with torch.random.fork_rng():
        tokenizer = build_tokenizer()
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

        # policy: next-token prediction on "prompt response <eos>"
        policy = GPT2LMHeadModel(tiny_config(tokenizer))
        rows = [tokenizer(f"{p} {r}")["input_ids"] + [eos] for p, r in sentiment.corpus(6000, seed=seed)]
        optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
        step, lm_loss = 0, float("nan")
        while step < policy_steps:
            for ids, mask, _ in _batches(rows, None, 64, rng, pad):
                labels = ids.masked_fill(mask == 0, -100)
                loss = policy(input_ids=ids, attention_mask=mask, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step, lm_loss = step + 1, float(loss.detach())
                if step >= policy_steps:
                    break
        log(f"policy: {sum(p.numel() for p in policy.parameters()):,} params, LM loss {lm_loss:.3f} after {step} steps")

        # reward model: regress the gold reward from "prompt response <eos>", read at the last token
        reward = GPT2ForSequenceClassification(tiny_config(tokenizer, num_labels=1))
        pairs = _reward_texts(rng, 8000)
        targets = sentiment.gold_reward([p for p, _ in pairs], [r for _, r in pairs])
        rrows = [tokenizer(f"{p} {r}")["input_ids"] + [eos] for p, r in pairs]
        optimizer = torch.optim.AdamW(reward.parameters(), lr=3e-3)
        step, rm_loss = 0, float("nan")
        while step < reward_steps:
            for ids, mask, target in _batches(rrows, targets, 64, rng, pad):
                reward.train()
                with torch.enable_grad():
                    scores = _scores_with_grad(reward, ids, mask.sum(1))
                    loss = torch.nn.functional.mse_loss(scores, target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step, rm_loss = step + 1, float(loss.detach())
                if step >= reward_steps:
                    break
        log(f"reward: MSE {rm_loss:.4f} to the gold reward after {step} steps")

        paths = {name: out / name for name in ("policy", "reward", "critic")}
        for name, model in (("policy", policy), ("reward", reward)):
            model.eval()
            model.save_pretrained(paths[name])
            tokenizer.save_pretrained(paths[name])
        critic = init_critic(None, str(paths["reward"]))
        critic.save_pretrained(paths["critic"])
        tokenizer.save_pretrained(paths["critic"])
        info = {"seed": seed, "policy_lm_loss": lm_loss, "reward_mse": rm_loss, "seconds": round(time.time() - started, 1),
                "paths": {k: str(v) for k, v in paths.items()}}
        (out / "tiny.json").write_text(json.dumps(info, indent=2))
    return info


def _scores_with_grad(model, ids, lengths):
    hidden = model.base_model(input_ids=ids, attention_mask=(torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()).last_hidden_state
    return model.score(hidden[torch.arange(ids.shape[0]), lengths - 1]).squeeze(-1)


def ensure_tiny(out: str | Path, seed: int = 0, log=print) -> Path:
    """Build the embedded default under `out` unless it is there: once, even when several runs start together.

    An exclusive lock on `<out>.lock` serialises builders; the models are written to a temporary sibling directory
    and renamed into place, so `out` is either absent or complete (tiny.json written last), never half-written.
    """
    import fcntl
    import os
    import shutil
    import tempfile

    out = Path(out)
    if (out / "tiny.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if (out / "tiny.json").exists():  # another process built it while we waited
            return out
        log(f"building the embedded default models (tiny policy, reward, critic) in {out} (once, ~30 s)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            info = build_tiny(tmp, seed=seed, log=lambda *_: None)
            info["paths"] = {k: str(out / k) for k in info["paths"]}
            (tmp / "tiny.json").write_text(json.dumps(info, indent=2))
            shutil.rmtree(out, ignore_errors=True)  # a partial directory from an older version of this code
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
