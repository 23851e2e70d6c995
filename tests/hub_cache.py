"""A user's model as the Hugging Face cache holds it, built here (nothing is downloaded): a small Qwen2-architecture
causal LM with a byte-level BPE tokenizer of its own and a ChatML chat template, a Qwen2 reward model of the same
tokenizer, and `put_in_cache`, which lays a saved model out as huggingface_hub itself does
(models--org--name/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<branch>), so the code under
test finds it exactly as it finds a model `hf download` fetched.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [f"Q: what is {a} plus {b}? A: {a} + {b} = {a + b}. #### {a + b}" for a in range(12) for b in range(12)] + \
         ["Natalia sold clips to her friends in April, and then she sold half as many clips in May.",
          "user assistant system question answer the number is the total of the numbers"]


def build_tokenizer():
    """A byte-level BPE tokenizer trained on a few hundred arithmetic lines (~400 tokens), with Qwen's special
    tokens and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="right")
    out.chat_template = CHAT_TEMPLATE
    return out


def qwen2_config(tokenizer, **kw):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **kw)


def build_qwen2(out: Path, seed: int = 0, reward: bool = False) -> Path:
    """A random-initialised (seeded) Qwen2 causal LM, or with `reward` a Qwen2 sequence classifier with one label,
    saved with its tokenizer (and the LM's generation config) into `out`."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    if reward:
        model = Qwen2ForSequenceClassification(qwen2_config(tokenizer, num_labels=1))
    else:
        model = Qwen2ForCausalLM(qwen2_config(tokenizer))
        model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id,
                                                                 tokenizer.convert_tokens_to_ids("<|endoftext|>")],
                                                   pad_token_id=tokenizer.pad_token_id, do_sample=True,
                                                   temperature=0.7, top_p=0.8)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


def put_in_cache(source: Path, cache: Path, repo_id: str, branch: str = "main", repo_type: str = "model") -> str:
    """Lay the files of `source` out in the hub cache `cache` as repo `repo_id` (a model or a dataset) at `branch`
    (huggingface_hub's layout); returns the commit hash the branch points to."""
    repo = Path(cache) / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(source).rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files) + branch.encode()).hexdigest()
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return commit
