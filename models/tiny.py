"""`rlhf models tiny`: build, offline and from a seed, a tiny policy, reward model and critic for the shipped task.

The policy is a GPT-2-style causal LM briefly pretrained on the task's synthetic review corpus (so it writes
grammatical, sentiment-balanced reviews and ends them with EOS); the reward model is trained to regress the gold
reward; the critic is initialised from the reward model. `reward-chars` is a second reward model for the same gold
reward with a tokenizer of its own (characters, a Llama backbone): a reward model that does not share the policy's
tokenizer, so the text transport (`reward_text`) runs end to end offline. Everything is written with
`save_pretrained`, and is loaded back through the same `from_pretrained` code a user's real checkpoint takes.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models as tok_models, pre_tokenizers
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig,
                          LlamaForSequenceClassification, PreTrainedTokenizerFast, get_cosine_schedule_with_warmup)

from models.critic import init_critic
from models.tasks import sentiment

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build_tokenizer(chars: bool = False) -> PreTrainedTokenizerFast:
    """The task's word-level tokenizer, or with `chars` a character-level one (every character of the task's
    vocabulary and the space is a token)."""
    if chars:
        symbols = sorted(set("".join(sentiment.vocabulary())) | {" "})
        tok = Tokenizer(tok_models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + symbols)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok = Tokenizer(tok_models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + sentiment.vocabulary())},
                                             unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="right")


def tiny_config(tokenizer, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, **kw) -> GPT2Config:
    return GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)


def _batches(rows: list[list[int]], batch: int, rng: random.Random, pad: int):
    """Shuffled right-padded batches: (ids [batch, L], mask [batch, L], row indices [batch])."""
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
        yield ids, mask, torch.tensor(idx)


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


def char_reward_model(tokenizer) -> LlamaForSequenceClassification:
    """A 2-layer Llama (rotary positions make the local patterns that spell a word easy to learn) with a score head."""
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))


def prefix_rewards(text: str) -> list[float]:
    """Targets for each character of `text` followed by EOS: the gold reward of the words before each space, and of
    the whole text at EOS; NaN elsewhere (inside a word, whose polarity is not known yet).

    Training a causal reward model on every prefix, not only on the last token, gives it ~20 targets per text
    instead of one: a character-level model then learns the gold reward in ~600 steps instead of stalling.
    """
    return [sentiment.gold_reward([""], [text[:i]])[0] if c == " " else float("nan") for i, c in enumerate(text + " ")]


def build_tiny(out: str | Path, seed: int = 0, policy_steps: int = 600, reward_steps: int = 600, log=print) -> dict:
    """Build tokenizer + policy + reward + critic + reward-chars under `out`; returns their paths and final losses."""
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
        lm_loss = _fit(policy, rows, policy_steps, rng, pad, lambda ids, mask, _: policy(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
        log(f"policy: {sum(p.numel() for p in policy.parameters()):,} params, LM loss {lm_loss:.3f} after {policy_steps} steps")

        # reward model: regress the gold reward from "prompt response <eos>", read at the last token
        reward = GPT2ForSequenceClassification(tiny_config(tokenizer, num_labels=1))
        pairs = _reward_texts(rng, 8000)
        targets = torch.tensor(sentiment.gold_reward([p for p, _ in pairs], [r for _, r in pairs]))
        rrows = [tokenizer(f"{p} {r}")["input_ids"] + [eos] for p, r in pairs]
        rm_loss = _fit(reward, rrows, reward_steps, rng, pad, lambda ids, mask, idx: torch.nn.functional.mse_loss(
            _scores_with_grad(reward, ids, mask.sum(1)), targets[idx]))
        log(f"reward: MSE {rm_loss:.4f} to the gold reward after {reward_steps} steps")

        # reward-chars: the same pairs and gold reward, its own (character) tokenizer; every prefix is a target
        chars = build_tokenizer(chars=True)
        reward_chars = char_reward_model(chars)
        crows = [chars(f"{p} {r}")["input_ids"] + [chars.eos_token_id] for p, r in pairs]
        ctargets = [torch.tensor(prefix_rewards(f"{p} {r}")) for p, r in pairs]

        def prefix_loss(ids, mask, idx):
            target = torch.full(ids.shape, float("nan"))
            for j, i in enumerate(idx.tolist()):
                target[j, :len(ctargets[i])] = ctargets[i]
            scores = reward_chars.score(reward_chars.base_model(input_ids=ids, attention_mask=mask).last_hidden_state)
            known = ~target.isnan()
            return torch.nn.functional.mse_loss(scores.squeeze(-1)[known], target[known])

        chars_loss = _fit(reward_chars, crows, reward_steps, rng, chars.pad_token_id, prefix_loss, warmup=True)
        log(f"reward-chars: MSE {chars_loss:.4f} to the gold reward of every prefix after {reward_steps} steps")

        paths = {name: out / name for name in ("policy", "reward", "critic", "reward-chars")}
        for name, model, tok in (("policy", policy, tokenizer), ("reward", reward, tokenizer),
                                 ("reward-chars", reward_chars, chars)):
            model.eval()
            model.save_pretrained(paths[name])
            tok.save_pretrained(paths[name])
        critic = init_critic(None, str(paths["reward"]))
        critic.save_pretrained(paths["critic"])
        tokenizer.save_pretrained(paths["critic"])
        info = {"seed": seed, "policy_lm_loss": lm_loss, "reward_mse": rm_loss, "reward_chars_mse": chars_loss,
                "seconds": round(time.time() - started, 1),
                "paths": {k: str(v) for k, v in paths.items()}}
        (out / "tiny.json").write_text(json.dumps(info, indent=2))
    return info


def _fit(model, rows: list[list[int]], steps: int, rng: random.Random, pad: int, loss_of, warmup: bool = False) -> float:
    """AdamW (lr 3e-3; with `warmup`, 10% linear warm-up then cosine decay) on shuffled batches of 64 rows for `steps`
    steps; `loss_of(ids, mask, row_indices)` gives the batch loss. Returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = get_cosine_schedule_with_warmup(optimizer, steps // 10, steps) if warmup else None
    model.train()
    step, loss = 0, float("nan")
    while step < steps:
        for ids, mask, idx in _batches(rows, 64, rng, pad):
            with torch.enable_grad():
                batch_loss = loss_of(ids, mask, idx)
            optimizer.zero_grad()
            batch_loss.backward()
            optimizer.step()
            if schedule is not None:
                schedule.step()
            step, loss = step + 1, float(batch_loss.detach())
            if step >= steps:
                break
    return loss


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
        log(f"building the embedded default models (tiny policy, reward, critic, reward-chars) in {out} (once, ~90 s)")
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
