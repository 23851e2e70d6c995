"""`rlhf models tiny`: the script that built the embedded default (models/assets/tiny, shipped with the package:
models/tiny_files.py), offline and from a seed: a tiny policy, reward model and critic for the shipped task.

The policy is a GPT-2-style causal LM briefly pretrained on the task's synthetic review corpus (so it writes
grammatical, sentiment-balanced reviews and ends them with EOS); the reward model is trained to regress the gold
reward; the critic is initialised from the reward model. `reward-chars` is a second reward model for the same gold
reward with a tokenizer of its own (characters, a Llama backbone): a reward model that does not share the policy's
tokenizer, so the text transport (`reward_text`) runs end to end offline. Everything is written with
`save_pretrained`, and is loaded back through the same `from_pretrained` code a user's real checkpoint takes.

The policy, reward and critic are built together (~40 s on 2 cores), `reward-chars` (~55 s) from a random stream of
its own. What they come out as depends on the CPU's kernels (AVX2 and AVX-512 machines, and ATEN_CPU_CAPABILITY,
give other weights): runs never build them; they load the shipped files, the same bytes on every machine.
`chat` is a small chat model (a Llama: see `chat_model`) whose tokenizer carries Qwen2.5's chat template
(models/assets/templates/qwen2_5.jinja, byte for byte the one Qwen2.5's instruct models ship), its special tokens
(<|im_start|>, <|im_end|>, <tool_call>, </tool_call>, ...) and transformers' response template of the Qwen2
family (tokenizer_config.json `response_template`: what `tokenizer.parse_response` reads tool calls with): the model
the environment and tool-use path runs on (docs/environments.md). Its byte-level BPE (digits one by one, as Qwen2's;
merges across words, so the template's fixed text is a few tokens) is trained on conversations of
models/tasks/arithmetic.py, and the model is pretrained on conversations without a tool (small sums, repetitions):
calling a tool is what an SFT stage teaches it.

`rlhf models tiny --out DIR` builds all five and writes DIR/MANIFEST.json (how they were built, the sha256 of every
file and of every tensor as it loads); `--out models/assets/tiny` replaces the shipped ones. The shipped `chat` was
built apart (its MANIFEST entry's `built_with`: AVX-512 kernels, 2 torch threads) with `python -c "from models.tiny
import build_tiny; build_tiny('DIR', names=['chat'])"`. Which kernels build it matters beyond the bytes: the same
recipe built with ATEN_CPU_CAPABILITY=default on one thread also ends at a low reply loss (0.053), yet an SFT stage on
the calculator conversations never taught that build to copy the expression (0 of 128 right after 400 steps), while
the shipped one copies it after ~150 (docs/environments.md).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models as tok_models, normalizers, pre_tokenizers, trainers
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast,
                          get_cosine_schedule_with_warmup)

from models.critic import init_critic
from models.environments.chat import ChatFormat
from models.resolve import file_digests
from models.tasks import arithmetic, sentiment
from models.tiny_files import TEMPLATES_DIR

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
            response = " ".join(rng.choice(pool + ["the", noun, "is", "and", "very"])
                                for _ in range(rng.randint(1, 14)))
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


VERSION = 4  # of the embedded default's recipe (2: policy 2 heads x 32; 3: the chat model; 4: chat pretrained longer)
BASE = ("policy", "reward", "critic")  # built together: the reward model's data follow the policy's in one stream
CHARS = "reward-chars"  # built only when named, from a random stream of its own
CHAT = "chat"  # the same: a stream of its own
NAMES = BASE + (CHARS, CHAT)
DEFAULT_STEPS = 600  # training steps of each model when build_tiny is not given a count (the embedded default)
# the chat model's pretraining steps: at 600 (recipe 3) it had not learnt to copy numbers (an SFT stage on the
# calculator conversations then left it copying the expression right in 8 % of greedy episodes after 400 steps); at 2000
# the shipped build copies them (the same SFT: 100 % after 400 steps; the copying sets in at ~150)
CHAT_STEPS = 2000


def _names(names: Iterable[str]) -> set[str]:
    names = set([names] if isinstance(names, str) else names)
    unknown = names - set(NAMES)
    if unknown:
        raise ValueError(f"unknown tiny model(s) {sorted(unknown)}; known: {', '.join(NAMES)}")
    return names


def _stream_seed(seed: int, name: str) -> int:
    """A seed of its own for `name`'s random streams, derived from the build's seed (stable across processes)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:7], "little")


def build_tiny(out: str | Path, seed: int = 0, policy_steps: int | None = None, reward_steps: int | None = None,
               log=print, names: Iterable[str] = NAMES, chat_steps: int | None = None) -> dict:
    """Build the named tiny models under `out` (`out/<name>`) and record them in `out/MANIFEST.json`; returns their
    paths and final losses.

    Naming any of policy, reward and critic builds all three (the critic is initialised from the reward model, whose
    data are drawn after the policy's from one stream of `seed`); `reward-chars` is built only when named, from a
    stream of its own, so the other three are the same whether it is built or not. `policy_steps` / `reward_steps`
    (default `DEFAULT_STEPS`) are the training steps of the policy and of each reward model, `chat_steps` (default
    `CHAT_STEPS`) the chat model's: fewer give a quick build with the same data, tokenizers and configs and less
    trained models (what tests of the build itself use).
    """
    names = _names(names)
    policy_steps = DEFAULT_STEPS if policy_steps is None else policy_steps
    reward_steps = DEFAULT_STEPS if reward_steps is None else reward_steps
    chat_steps = CHAT_STEPS if chat_steps is None else chat_steps
    out = Path(out)
    started = time.time()
    info: dict = {"version": VERSION, "seed": seed, "policy_steps": policy_steps, "reward_steps": reward_steps}
    built: list[str] = []
    if names & set(BASE):
        info.update(_build_base(out, seed, policy_steps, reward_steps, log))
        built += BASE
    if CHARS in names:
        info.update(_build_reward_chars(out / CHARS, seed, reward_steps, log))
        built.append(CHARS)
    if CHAT in names:
        info["chat_steps"] = chat_steps
        info.update(_build_chat(out / CHAT, seed, chat_steps, log))
        built.append(CHAT)
    info["seconds"] = round(time.time() - started, 1)
    info["paths"] = {name: str(out / name) for name in built}
    write_manifest(out, info)
    return info


def _build_base(out: Path, seed: int, policy_steps: int, reward_steps: int, log) -> dict:
    """tokenizer + policy + reward + critic under `out`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    with torch.random.fork_rng():
        tokenizer = build_tokenizer()
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

        # policy: next-token prediction on "prompt response <eos>"; 2 heads of 32, the smallest head vLLM's CPU
        # attention serves (the vLLM rollout engine runs on this model too)
        policy = GPT2LMHeadModel(tiny_config(tokenizer, n_head=2))
        rows = [tokenizer(f"{p} {r}")["input_ids"] + [eos] for p, r in sentiment.corpus(6000, seed=seed)]
        lm_loss = _fit(policy, rows, policy_steps, rng, pad, lambda ids, mask, _: policy(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
        log(f"policy: {sum(p.numel() for p in policy.parameters()):,} params, LM loss {lm_loss:.3f} after "
            f"{policy_steps} steps")

        # reward model: regress the gold reward from "prompt response <eos>", read at the last token
        reward = GPT2ForSequenceClassification(tiny_config(tokenizer, num_labels=1))
        pairs = _reward_texts(rng, 8000)
        targets = torch.tensor(sentiment.gold_reward([p for p, _ in pairs], [r for _, r in pairs]))
        rrows = [tokenizer(f"{p} {r}")["input_ids"] + [eos] for p, r in pairs]
        rm_loss = _fit(reward, rrows, reward_steps, rng, pad, lambda ids, mask, idx: torch.nn.functional.mse_loss(
            _scores_with_grad(reward, ids, mask.sum(1)), targets[idx]))
        log(f"reward: MSE {rm_loss:.4f} to the gold reward after {reward_steps} steps")

        for name, model in (("policy", policy), ("reward", reward)):
            model.eval()
            model.save_pretrained(out / name)
            tokenizer.save_pretrained(out / name)
        critic = init_critic(None, str(out / "reward"))
        critic.save_pretrained(out / "critic")
        tokenizer.save_pretrained(out / "critic")
    return {"policy_lm_loss": lm_loss, "reward_mse": rm_loss}


def _build_reward_chars(path: Path, seed: int, steps: int, log) -> dict:
    """reward-chars: pairs like the reward model's and their gold reward, its own (character) tokenizer; every prefix
    is a target. Its random streams (data, initialisation, batches) are its own, derived from `seed`."""
    stream = _stream_seed(seed, CHARS)
    rng = random.Random(stream)
    with torch.random.fork_rng():
        torch.manual_seed(stream)
        pairs = _reward_texts(rng, 8000)
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

        chars_loss = _fit(reward_chars, crows, steps, rng, chars.pad_token_id, prefix_loss, warmup=True)
        log(f"reward-chars: MSE {chars_loss:.4f} to the gold reward of every prefix after {steps} steps")
        reward_chars.eval()
        reward_chars.save_pretrained(path)
        chars.save_pretrained(path)
    return {"reward_chars_mse": chars_loss}


# ---------------------------------------------------------------- the chat model (Qwen2.5's chat format)

# Qwen2.5's added tokens, in its order; <|endoftext|> pads, <|im_end|> ends a turn (eos)
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}  # added tokens that decode as text (Qwen2.5: special=False)
# pieces the BPE never merges across: single digits (as Qwen2's pre-tokenizer keeps them) and newlines; anything
# else may merge, so the template's fixed text (the tools' system prompt) becomes a few long tokens and a conversation
# ~100 tokens instead of ~250: a tiny model trains on it in seconds
CHAT_SPLIT = r"\p{N}|\n"
CHAT_VOCAB = 1024


def chat_template() -> str:
    """Qwen2.5's chat template (models/assets/templates/qwen2_5.jinja)."""
    return (TEMPLATES_DIR / "qwen2_5.jinja").read_text()


def qwen2_response_template() -> dict:
    """transformers' response template of the Qwen2 family (the one `transformers serve` falls back to for model type
    qwen2): what `tokenizer.parse_response` reads an assistant turn, its tool calls included, with."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS  # heavy (~4 s): the build only

    return next(template for types, template in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen2" in types)


def build_chat_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most CHAT_VOCAB ids trained on `texts` (split at digits and newlines only), with
    Qwen2.5's special tokens, chat template and the Qwen2 response template."""
    tok = Tokenizer(tok_models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CHAT_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CHAT_VOCAB, special_tokens=CHAT_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        padding_side="right", clean_up_tokenization_spaces=False,
                                        additional_special_tokens=[t for t in CHAT_SPECIAL if t not in NOT_SPECIAL
                                                                   and t not in ("<|endoftext|>", "<|im_end|>")])
    tokenizer.chat_template = chat_template()
    tokenizer.response_template = qwen2_response_template()
    return tokenizer


def chat_model(tokenizer) -> LlamaForCausalLM:
    """A Llama of 3 layers of 96 (3 heads of 32: the smallest head vLLM's CPU attention serves), rotary positions up
    to 512. Not the Qwen2 architecture: transformers loads a model of type qwen2 with its Qwen2Tokenizer, which puts
    Qwen2's word-level pre-tokenizer in place of the tokenizer's own (the long merged tokens would be lost); a llama
    model's tokenizer loads as saved."""
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def _build_chat(path: Path, seed: int, steps: int, log) -> dict:
    """chat: the tokenizer trained on rendered conversations (with and without the calculator's tool schema), then
    the model pretrained on conversations without a tool; its random streams are its own, derived from `seed`."""
    stream = _stream_seed(seed, CHAT)
    rng = random.Random(stream)
    with torch.random.fork_rng():
        torch.manual_seed(stream)
        corpus = arithmetic.chat_corpus(8000, seed=rng.randrange(10**6))
        demos = arithmetic.sft_rows(400, seed=rng.randrange(10**6))
        plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.BPE()))
        plain.chat_template = chat_template()
        texts = [plain.apply_chat_template(c, tokenize=False) for c in corpus[:2000]]
        texts += [plain.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False) for d in demos]
        tokenizer = build_chat_tokenizer(texts)
        model = chat_model(tokenizer)
        rows, masks = [], []
        chat = ChatFormat(tokenizer)
        for conversation in corpus:  # loss on the assistant's replies and their ends of turn, as an SFT stage takes it
            ids, mask = chat.conversation(conversation)
            rows.append(ids)
            masks.append(mask)
        pad = tokenizer.pad_token_id

        def reply_loss(ids, mask, idx):
            labels = torch.full(ids.shape, -100)
            for j, i in enumerate(idx.tolist()):
                labels[j, :len(rows[i])] = torch.where(torch.tensor(masks[i]) > 0, torch.tensor(rows[i]), -100)
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss

        loss = _fit(model, rows, steps, rng, pad, reply_loss, warmup=True, log=log)
        log(f"chat: {sum(p.numel() for p in model.parameters()):,} params, reply loss {loss:.3f} after {steps} steps")
        model.eval()
        model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, pad], pad_token_id=pad)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return {"chat_reply_loss": loss}


def _fit(model, rows: list[list[int]], steps: int, rng: random.Random, pad: int, loss_of, warmup: bool = False,
         log=None) -> float:
    """AdamW (lr 3e-3; with `warmup`, 10% linear warm-up then cosine decay) on shuffled batches of 64 rows for `steps`
    steps; `loss_of(ids, mask, row_indices)` gives the batch loss. Returns the last loss (`log`: told every 100
    steps)."""
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
            if log is not None and step % 100 == 0:
                log(f"  step {step}/{steps}: loss {loss:.3f}")
            if step >= steps:
                break
    return loss


def _scores_with_grad(model, ids, lengths):
    attention_mask = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()
    hidden = model.base_model(input_ids=ids, attention_mask=attention_mask).last_hidden_state
    return model.score(hidden[torch.arange(ids.shape[0]), lengths - 1]).squeeze(-1)


def state_digest(model) -> str:
    """sha256 over a model's state dict as it loaded (names, dtypes, shapes and bytes, in name order): equal only
    for bitwise-equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


LOADERS = {"policy": "AutoModelForCausalLM", "reward": "AutoModelForSequenceClassification",
           "critic": "AutoModelForTokenClassification", CHARS: "AutoModelForSequenceClassification",
           CHAT: "AutoModelForCausalLM"}


def load_digests(out: str | Path) -> dict[str, str]:
    """state_digest of each model under `out` as `from_pretrained` loads it (the class a run loads it with)."""
    import transformers  # heavy (~3 s): its model registry, only to check what the build wrote

    return {name: state_digest(getattr(transformers, cls).from_pretrained(Path(out) / name))
            for name, cls in LOADERS.items() if (Path(out) / name).is_dir()}


def write_manifest(out: str | Path, info: dict) -> dict:
    """out/MANIFEST.json: the build's info, where it was built (torch, CPU capability), and per model the sha256 of
    its files and of its state dict as it loads."""
    out = Path(out)
    manifest = {"recipe": {k: v for k, v in info.items() if k not in ("paths", "seconds")},
                "built_with": {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "threads": torch.get_num_threads()},
                "models": {name: {"files": file_digests(out / name), "state_sha256": digest}
                           for name, digest in load_digests(out).items()}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
