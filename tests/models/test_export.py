"""The trained policy out (models/export.py): a checkpoint's actor/ (full weights or a LoRA adapter) as one Hugging
Face directory that plain transformers loads: the weights (LoRA merged: base + scale * B @ A, checked in float64) in
the run's dtype, its config and generation config, the tokenizer with its chat template."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.config import LoraConfig
from models.export import export_policy, is_lora
from models.policy import Policy
from tests.hub_cache import build_qwen2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small Qwen2 model with a chat template and a generation config of its own (stop ids, sampling)."""
    return build_qwen2(tmp_path_factory.mktemp("base") / "qwen")


def trained(policy: Policy, seed: int = 0) -> Policy:
    """Move the trainable weights as training would (a seeded step away from the start)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.05)
    return policy


def test_a_full_fine_tune_exports_its_weights_in_the_runs_dtype_with_tokenizer_and_generation_config(base, tmp_path):
    policy = trained(Policy.load(str(base)))
    policy.save(tmp_path / "actor")  # what a checkpoint's actor/ holds
    assert not is_lora(tmp_path / "actor")
    out = export_policy(tmp_path / "actor", tmp_path / "model", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, nothing of this project
    assert model.dtype == torch.bfloat16
    trained_weights = policy.model.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained_weights[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"].float(),
                           AutoModelForCausalLM.from_pretrained(base).state_dict()["model.embed_tokens.weight"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(base).chat_template
    assert model.generation_config.eos_token_id == AutoModelForCausalLM.from_pretrained(base).generation_config.eos_token_id
    assert model.generation_config.top_p == 0.8
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    with pytest.raises(FileExistsError, match="is not empty"):
        export_policy(tmp_path / "actor", out)


def test_a_lora_run_exports_the_base_with_the_adapter_merged(base, tmp_path):
    lora = LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    policy = trained(Policy.load(str(base), lora))
    policy.save(tmp_path / "actor")  # the adapter alone
    assert is_lora(tmp_path / "actor")
    with pytest.raises(ValueError, match="merging it needs the base model"):
        export_policy(tmp_path / "actor", tmp_path / "nope")
    out = export_policy(tmp_path / "actor", tmp_path / "model", base=str(base), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    start = AutoModelForCausalLM.from_pretrained(base).state_dict()
    adapters = {name: tensor.double() for name, tensor in policy.model.state_dict().items() if "lora_" in name}
    scale = lora.alpha / lora.r
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            delta = adapters[f"{prefix}.lora_B.default.weight"] @ adapters[f"{prefix}.lora_A.default.weight"] * scale
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            torch.testing.assert_close(merged[name].double(), start[name].double() + delta, rtol=0, atol=1e-6)
    untouched = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(merged[untouched], start[untouched])
    # the merged model computes what the actor with its adapter computes
    tokens = torch.tensor([[5, 17, 30, 42, 8]])
    with torch.no_grad():
        expected = policy.model(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(out)(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name in merged)
