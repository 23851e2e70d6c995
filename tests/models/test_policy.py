"""Policy and the native rollout engine: KV-cache generation (EOS, padding, is_end), logprobs, sampling filters, the
frozen reference (copy vs LoRA), the weights a rollout engine receives (tied lm_head, LoRA merged)."""

import pytest
import torch

from models.config import GenerationConfig, LoraConfig
from models.policy import Policy
from models.rollout import NativeEngine
from models.rollout.native import sample
from models.tasks import sentiment


@pytest.fixture(scope="module")
def policy(tiny_models):
    return Policy.load(tiny_models["policy"])


@pytest.mark.parametrize("max_new_tokens", [4, 24])
def test_generation_stops_at_eos_and_pads(policy, max_new_tokens):
    prompts = sentiment.prompts(32)
    ids = policy.encode_prompts(prompts)
    ro = NativeEngine.for_policy(policy).generate(ids, GenerationConfig(max_new_tokens=max_new_tokens), torch.Generator().manual_seed(0))
    eos, pad = policy.eos_id, policy.pad_id
    for i, prompt in enumerate(ids):
        row = ro.tokens[i].tolist()
        p, n = ro.prompt_lengths[i].item(), ro.lengths[i].item()
        assert row[:p] == prompt
        response = row[p:n]
        assert all(t == pad for t in row[n:])
        assert eos not in response[:-1]
        assert ro.is_end[i].item() == (response[-1] == eos)
        if not ro.is_end[i]:
            assert len(response) == max_new_tokens
    if max_new_tokens == 4:
        assert (~ro.is_end).any()  # some truncated
    else:
        assert ro.is_end.all()  # the pretrained tiny policy ends its reviews
    mask = ro.response_mask
    assert torch.equal(mask.sum(1).long(), ro.response_lengths)


def test_sampling_logprobs_match_recomputation(policy):
    ids = policy.encode_prompts(sentiment.prompts(16))
    ro = NativeEngine.for_policy(policy).generate(ids, GenerationConfig(max_new_tokens=12, temperature=0.7), torch.Generator().manual_seed(3))
    with torch.no_grad():
        logp, entropy = policy.logprobs(ro.tokens, ro.lengths, temperature=0.7, with_entropy=True)
    mask = ro.response_mask
    torch.testing.assert_close(logp * mask, ro.sample_logprobs, atol=2e-5, rtol=0)
    assert (entropy >= 0).all()
    # batch composition does not change a row's logprobs (right padding + attention mask)
    with torch.no_grad():
        single = policy.logprobs(ro.tokens[:1, : ro.lengths[0]], ro.lengths[:1], temperature=0.7)[0]
    torch.testing.assert_close(single[0], logp[0, : ro.lengths[0] - 1], atol=2e-5, rtol=0)


def test_reference_copy_is_frozen_and_independent(tiny_models):
    pol = Policy.load(tiny_models["policy"])
    assert pol.reference is not None and all(not p.requires_grad for p in pol.reference.parameters())
    tokens = torch.tensor([policy_tokens(pol)])
    lengths = torch.tensor([tokens.shape[1]])
    before = pol.logprobs(tokens, lengths, reference=True)[0]
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(0.05)
    after_ref = pol.logprobs(tokens, lengths, reference=True)[0]
    actor = pol.logprobs(tokens, lengths)[0].detach()
    torch.testing.assert_close(before, after_ref)
    assert not torch.allclose(actor, after_ref)


def policy_tokens(pol):
    return pol.encode_prompts(["tell me about the cat : the cat is good ."])[0]


def test_lora_reference_is_base_model_without_copy(tiny_models):
    base = Policy.load(tiny_models["policy"])
    lora = Policy.load(tiny_models["policy"], LoraConfig(enabled=True, r=4, alpha=8, target_modules=["c_attn", "c_proj"]))
    assert lora.reference is None
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    n_params = sum(p.numel() for p in lora.model.parameters())
    n_base = sum(p.numel() for p in base.model.parameters())
    n_lora = sum(p.numel() for n, p in lora.model.named_parameters() if "lora_" in n)
    assert n_params == n_base + n_lora  # no second copy of the base weights anywhere
    tokens = torch.tensor([policy_tokens(lora)])
    lengths = torch.tensor([tokens.shape[1]])
    # make the adapters non-trivial, then: reference (adapters disabled) == base model, actor != base
    with torch.no_grad():
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ref = lora.logprobs(tokens, lengths, reference=True)[0]
    base_logp = base.logprobs(tokens, lengths)[0].detach()
    torch.testing.assert_close(ref, base_logp, atol=1e-5, rtol=0)
    assert not torch.allclose(lora.logprobs(tokens, lengths)[0].detach(), base_logp, atol=1e-3)


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample(logits, top_k=2, generator=gen)
    assert set(top2.tolist()) == {0, 1}
    nucleus = sample(logits, top_p=0.7, generator=gen)  # smallest prefix reaching 0.7 mass: tokens 0 and 1
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).float().mean().item()
    assert share == pytest.approx(0.5 / 0.8, abs=0.05)
    everything = sample(logits, generator=gen)
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_missing_model_path_is_named():
    with pytest.raises(FileNotFoundError, match="model.policy.*does-not-exist"):
        Policy.load("/tmp/does-not-exist/policy")


def test_engine_weights_are_the_full_state_dict_with_the_tied_head(tiny_models):
    pol = Policy.load(tiny_models["policy"])
    weights = dict(pol.engine_weights())
    state = pol.model.state_dict()
    assert weights.keys() == state.keys() and "lm_head.weight" in weights  # the tied head is not left out
    for name, value in state.items():
        assert torch.equal(weights[name], value), name


def test_engine_weights_of_lora_are_the_merged_model_and_leave_the_actor_untouched(tiny_models):
    """The weights an engine receives for LoRA: base + scale * B @ A, under the base model's names, equal to what
    peft's merge_and_unload gives; the actor (and its adapters-disabled reference) is not modified."""
    import copy

    lora = Policy.load(tiny_models["policy"], LoraConfig(enabled=True, r=4, alpha=8, target_modules=["c_attn", "c_proj"]))
    with torch.no_grad():
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    before = {k: v.clone() for k, v in lora.model.state_dict().items()}
    weights = dict(lora.engine_weights())
    merged = copy.deepcopy(lora.model).merge_and_unload().state_dict()
    assert weights.keys() == merged.keys() and "lm_head.weight" in weights
    for name, value in merged.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=name)
    base = Policy.load(tiny_models["policy"]).model.state_dict()
    assert not torch.allclose(weights["transformer.h.0.attn.c_attn.weight"], base["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(weights["transformer.wte.weight"], base["transformer.wte.weight"])  # not adapted
    for name, value in lora.model.state_dict().items():
        assert torch.equal(value, before[name]), name
