"""Policy and the native rollout engine: KV-cache generation (EOS, padding, is_end, n samples per prompt), logprobs
of the distribution sampled (filters included, against float64), the frozen reference (copy vs LoRA), the weights a
rollout engine receives (tied lm_head, LoRA merged), and a rollout assembled from responses when pad == EOS."""

import pytest
import torch

from models.config import LoraConfig, Sampling
from models.engines import NativeEngine
from models.engines.base import SampleError, check_samples, from_responses
from models.engines.native import filtered, sample
from models.losses import mismatch_weights
from models.policy import Policy
from models.tasks import sentiment

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


@pytest.fixture(scope="module")
def policy(tiny_models):
    return Policy.load(tiny_models["policy"])


@pytest.mark.parametrize("max_new_tokens", [4, 24])
def test_generation_stops_at_eos_and_pads(policy, max_new_tokens):
    prompts = sentiment.prompts(32)
    ids = policy.encode_prompts(prompts)
    ro = NativeEngine.for_policy(policy).generate(ids, 1, Sampling(max_new_tokens=max_new_tokens),
                                                  torch.Generator().manual_seed(0))
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
    ro = NativeEngine.for_policy(policy).generate(ids, 1, Sampling(max_new_tokens=12, temperature=0.7),
                                                  torch.Generator().manual_seed(3))
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
    lora = Policy.load(tiny_models["policy"],
                       LoraConfig(enabled=True, r=4, alpha=8, target_modules=["c_attn", "c_proj"]))
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
    top2 = sample(filtered(logits, top_k=2), generator=gen)
    assert set(top2.tolist()) == {0, 1}
    nucleus = sample(filtered(logits, top_p=0.7), generator=gen)  # smallest prefix reaching 0.7 mass: tokens 0 and 1
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).float().mean().item()
    assert share == pytest.approx(0.5 / 0.8, abs=0.05)
    everything = sample(logits, generator=gen)
    assert set(everything.tolist()) == {0, 1, 2, 3}


def truncated_logprob64(logits: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float) -> float:
    """float64 reference: log-probability of `token` under softmax(logits / T) cut to the top-k tokens, then to the
    smallest prefix (by probability) whose mass reaches top_p, renormalised."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass, chosen = 0.0, []
    total = float(probs[kept].sum())
    for i in kept:
        chosen.append(i)
        mass += float(probs[i]) / total
        if mass >= top_p:
            break
    assert token in chosen, "a token outside the truncated distribution was sampled"
    return float(torch.log(probs[token] / probs[chosen].sum()))


def test_sampled_logprobs_are_those_of_the_truncated_distribution_and_tis_is_its_kept_mass(policy):
    """With top-k and top-p, `sample_logprobs` is the log-probability under the distribution actually sampled (the
    behaviour policy), checked against float64 reference code; the trainer's logprobs are of the full distribution,
    so the TIS weight min(pi_full / pi_truncated, cap) is the mass each step kept (< 1), capped."""
    ids = policy.encode_prompts(sentiment.prompts(6))
    sampling = Sampling(max_new_tokens=6, temperature=0.8, top_k=8, top_p=0.9)
    ro = NativeEngine.for_policy(policy).generate(ids, 2, sampling, torch.Generator().manual_seed(5))
    mask = ro.response_mask
    with torch.no_grad():
        logits = policy.model(input_ids=ro.tokens, attention_mask=(torch.arange(ro.tokens.shape[1])[None] <
                                                                     ro.lengths[:, None]).long()).logits
        full = policy.logprobs(ro.tokens, ro.lengths, 0.8)[0] * mask
    expected_tis = torch.zeros_like(mask, dtype=torch.float64)
    for i in range(len(ro)):
        for t in range(int(ro.prompt_lengths[i]) - 1, int(ro.lengths[i]) - 1):
            token = int(ro.tokens[i, t + 1])
            ref = truncated_logprob64(logits[i, t], token, 0.8, 8, 0.9)
            assert ro.sample_logprobs[i, t].item() == pytest.approx(ref, abs=1e-4), (i, t)
            expected_tis[i, t] = min(float(torch.exp(full[i, t].double() - ref)), 2.0)
    weights = mismatch_weights(full, ro.sample_logprobs, mask, "token_truncate", None, 2.0) * mask
    torch.testing.assert_close(weights.double(), expected_tis, atol=1e-4, rtol=0)
    on = mask > 0
    assert (weights[on] <= 1 + 1e-5).all() and (weights[on] < 0.999).any()  # the truncation dropped some mass


def test_n_samples_per_prompt_are_consecutive_and_independent(policy):
    ids = policy.encode_prompts(["review the cat :", "review the cat :", "review the dog :"])  # equal neighbours
    ro = NativeEngine.for_policy(policy).generate(ids, 4, Sampling(max_new_tokens=8), torch.Generator().manual_seed(0))
    assert len(ro) == 12
    for i in range(12):
        assert ro.tokens[i, :ro.prompt_lengths[i]].tolist() == ids[i // 4]
    responses = [tuple(ro.tokens[i, ro.prompt_lengths[i]:ro.lengths[i]].tolist()) for i in range(12)]
    assert len(set(responses[:4])) > 1 and len(set(responses[4:8])) > 1  # 4 samples each, not copies


def test_a_rollout_from_responses_keeps_pad_out_of_the_response_when_pad_is_eos():
    """pad == EOS (what load_policy_tokenizer does for a tokenizer without a pad token): the response mask covers the
    response, its EOS included, and no pad after it; a response that did not end has no EOS at all."""
    eos = pad = 2
    prompts = [[5, 6], [7], [8]]
    responses = [torch.tensor([11, eos]), torch.tensor([12, 13, 14]), torch.tensor([eos])]
    ro = from_responses(prompts, responses, [-torch.rand(len(r)) for r in responses], [True, False, True], pad)
    assert ro.tokens.tolist() == [[5, 6, 11, eos], [7, 12, 13, 14], [8, eos, pad, pad]]
    assert ro.response_mask.sum(1).tolist() == [2, 3, 1] and ro.is_end.tolist() == [True, False, True]
    for i, r in enumerate(responses):  # logprobs sit on the response's actions, nowhere else
        p = len(prompts[i])
        on_actions = ro.sample_logprobs[i][ro.response_mask[i] > 0].tolist()
        assert ro.sample_logprobs[i, p - 1:p - 1 + len(r)].tolist() == pytest.approx(on_actions)
        assert (ro.sample_logprobs[i][ro.response_mask[i] == 0] == 0).all()
    stops = torch.tensor([eos])
    check_samples([[11, eos], [12, 13, 14]], [[-1.0, -1.0], [-1.0] * 3], [True, False], stops, max_new_tokens=3)
    for bad, message in ((([eos, 11, eos],), "a stop token before its last token"),
                         (([11, 12],), "not is_end, but it has 2 of max_new_tokens=3"),
                         (([11, 12, 13],), "is_end, but its last token 13")):
        with pytest.raises(SampleError, match=message):
            check_samples(bad, [[-1.0] * len(bad[0])], [message.startswith("is_end") or bad[0][-1] == eos], stops, 3)


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

    lora = Policy.load(tiny_models["policy"],
                       LoraConfig(enabled=True, r=4, alpha=8, target_modules=["c_attn", "c_proj"]))
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
