"""The trained model out (models/export.py, the one export of every job): a checkpoint's trained part (full weights or
a LoRA adapter) as one Hugging Face directory that plain transformers loads: the weights (LoRA merged: base + scale *
B @ A, checked in float64) in the run's dtype, its config and generation config, the tokenizer with its chat
template; a reward model's LoRA adapter and score head merged alike, its reward statistics in its config; a base that
is not the one the adapter was trained on (by the digest its run recorded) refused. And the one precision policy: with
LoRA the frozen base is held in the compute dtype, the adapters (and a reward model's score head) in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from models.config import LoraConfig
from models.export import export_model, export_policy, is_lora
from models.policy import Policy
from models.resolve import directory_digest
from models.reward import check_loaded, reward_model_scores
from models.stages.train import Scorer
from tests.hub_cache import build_qwen2

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


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
    base_generation = AutoModelForCausalLM.from_pretrained(base).generation_config
    assert model.generation_config.eos_token_id == base_generation.eos_token_id
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


def test_a_reward_models_adapter_and_score_head_merge_onto_the_base_it_was_trained_on(tmp_path):
    """The reward-model stage with LoRA: its checkpoint holds the adapter and the score head (peft's
    modules_to_save); the export is a plain sequence classifier with one label, every weight from the file, scoring
    as the trained model does, with the reward statistics in its config. Given a base whose files are not the ones
    the run recorded (another seed), the export is refused naming both digests."""
    base = build_qwen2(tmp_path / "rm-base", reward=True)
    lora = LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    scorer = Scorer.load(str(base), lora, "float32", torch.device("cpu"))
    trained(scorer)
    scorer.save(tmp_path / "trainee")
    out = export_model(tmp_path / "trainee", tmp_path / "rm", base=str(base), task="sequence-classification",
                       config={"reward_mean": 0.25, "reward_std": 2.0}, base_digest=directory_digest(base))
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    check_loaded(info, str(out), "rm")  # no newly initialised weight: the score head came with the adapter
    assert (model.config.num_labels, model.config.reward_mean, model.config.reward_std) == (1, 0.25, 2.0)
    tokens, lengths = torch.tensor([[5, 17, 30, 42, 8], [9, 3, 3, 7, 2]]), torch.tensor([5, 3])
    with torch.no_grad():
        scorer.model.eval()
        expected = scorer.scores(tokens, lengths)
        got = reward_model_scores(model.eval(), tokens, lengths)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    other = build_qwen2(tmp_path / "other-base", seed=7, reward=True)
    with pytest.raises(ValueError, match=r"^export: the base model at .*other-base is not the one the adapter was "
                                         r"trained on: its files' digest is [0-9a-f]{64}, the run recorded"):
        export_model(tmp_path / "trainee", tmp_path / "rm2", base=str(other), task="sequence-classification",
                     base_digest=directory_digest(base))


def test_with_lora_the_frozen_base_is_held_in_the_compute_dtype_and_what_trains_in_float32(base):
    """model.dtype=bfloat16 with LoRA: the base weights are stored in bf16 (half of float32's bytes, as peft, TRL
    and veRL hold them), the adapters in float32 (master weights: AdamW in bf16 would lose updates); a step moves
    the adapters only. The reward-model trainer alike, its new score head trained in float32."""
    lora = LoraConfig(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    low, full = Policy.load(str(base), lora, dtype="bfloat16"), Policy.load(str(base), lora, dtype="float32")
    frozen = {n: p.dtype for n, p in low.model.named_parameters() if not p.requires_grad}
    trainable = {n: p.dtype for n, p in low.model.named_parameters() if p.requires_grad}
    assert set(frozen.values()) == {torch.bfloat16} and trainable and set(trainable.values()) == {torch.float32}
    assert all("lora_" in n for n in trainable)

    def nbytes(model, trains: bool) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad == trains)

    assert nbytes(low.model, False) * 2 == nbytes(full.model, False)  # the frozen base: half the bytes
    assert nbytes(low.model, True) == nbytes(full.model, True)
    tokens, lengths = torch.tensor([[5, 17, 30, 42, 8]]), torch.tensor([5])
    before = {n: p.detach().clone() for n, p in low.model.named_parameters()}
    optimizer = torch.optim.AdamW(low.trainable_parameters(), lr=1e-2)
    (-low.logprobs(tokens, lengths)[0].mean()).backward()
    optimizer.step()
    moved = {n for n, p in low.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(trainable)  # the base never moves
    with torch.no_grad():  # the reference (adapters disabled) computes with the bf16 base, as the actor does
        torch.testing.assert_close(low.logprobs(tokens, lengths, reference=True)[0],
                                   full.logprobs(tokens, lengths, reference=True)[0], rtol=0, atol=0.1)
    scorer = Scorer.load(str(build_qwen2(base.parent / "rm", reward=True)), lora, "bfloat16", torch.device("cpu"))
    scorer_trainable = {n: p.dtype for n, p in scorer.model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in scorer_trainable) and set(scorer_trainable.values()) == {torch.float32}
    assert {p.dtype for p in scorer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
