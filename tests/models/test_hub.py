"""A user's model by its hub id: loaded from the Hugging Face cache with no network (a small Qwen2 model with its own
BPE tokenizer and chat template, laid out in a temporary HF_HUB_CACHE as huggingface_hub lays it out), at
model.revision; a missing one fails naming the field, the id and the command that fetches it. And what prepare_run
decides about the models a user did not give: the critic and a token-transport reward model must read the policy's
tokens, checked before any weights load."""

from __future__ import annotations

import pytest
import torch

from models.config import preset
from models.hub import resolve_model
from models.prepare import prepare_run
from tests.hub_cache import build_qwen2, put_in_cache

POLICY, REWARD = "acme/tiny-qwen", "acme/tiny-qwen-rm"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache holding acme/tiny-qwen (main, and a branch v2 with other weights) and acme/tiny-qwen-rm; this
    module's processes read it with the hub out of reach."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    main = put_in_cache(build_qwen2(root / "policy"), cache, POLICY)
    v2 = put_in_cache(build_qwen2(root / "policy-v2", seed=1), cache, POLICY, branch="v2")
    put_in_cache(build_qwen2(root / "reward", reward=True), cache, REWARD)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield {"root": root, "cache": cache, "main": main, "v2": v2}


def user_cfg(tmp_path, **overrides):
    return preset("none", **{"deploy.state_dir": str(tmp_path), "model.policy": POLICY,
                             "data.prompts": "builtin:sentiment", **overrides})


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_cached_hub_id_loads_offline_as_policy_tokenizer_reward_model_and_critic(hub, tmp_path):
    """Every model loads from the cache's snapshot, the same tensors as the directory that was put there."""
    from transformers import AutoModelForCausalLM

    from models.critic import init_critic
    from models.policy import Policy, load_policy_tokenizer
    from models.reward import load_reward_model

    cfg = prepare_run(user_cfg(tmp_path, **{"model.reward": REWARD, "algorithm": "ppo"}))
    snapshot = cfg.resolve_model_path(POLICY)
    assert snapshot == str(hub["cache"] / "models--acme--tiny-qwen" / "snapshots" / hub["main"])
    tokenizer = load_policy_tokenizer(snapshot)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 plus 3?"}], add_generation_prompt=True, tokenize=False)
    policy = Policy.load(snapshot)
    expected = weights(AutoModelForCausalLM.from_pretrained(hub["root"] / "policy"))
    got = weights(policy.model)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    reward = load_reward_model(cfg.resolve_model_path(REWARD))
    assert type(reward).__name__ == "Qwen2ForSequenceClassification"
    assert cfg.model.critic is None  # the reward model shares the policy's tokenizer: the critic starts from it
    critic = init_critic(None, cfg.resolve_model_path(REWARD))
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert cfg.reward.transport == "tokens"


def test_model_revision_picks_a_branch_or_commit_of_the_policy_id(hub, tmp_path):
    v2 = user_cfg(tmp_path, **{"model.revision": "v2"})
    assert v2.resolve_model_path(POLICY).endswith(hub["v2"])
    assert user_cfg(tmp_path, **{"model.revision": hub["main"]}).resolve_model_path(POLICY).endswith(hub["main"])
    # the policy's revision applies to another field naming the same id, not to another id
    same = user_cfg(tmp_path, **{"model.revision": "v2", "model.critic": POLICY, "model.reward": REWARD})
    assert same.resolve_model_path(same.model.critic).endswith(hub["v2"])
    assert "models--acme--tiny-qwen-rm" in same.resolve_model_path(REWARD)


@pytest.mark.parametrize("overrides, field, missing, command", [
    ({"model.policy": "acme/not-cached"}, "model.policy", "acme/not-cached", "hf download acme/not-cached"),
    ({"model.revision": "v3"}, "model.policy", POLICY, f"hf download {POLICY} --revision v3"),
    ({"model.reward": "acme/no-rm"}, "model.reward", "acme/no-rm", "hf download acme/no-rm"),
])
def test_a_model_not_in_the_cache_fails_naming_the_field_the_id_and_the_command(hub, tmp_path, overrides, field,
                                                                                  missing, command):
    with pytest.raises(FileNotFoundError) as failure:
        prepare_run(user_cfg(tmp_path, **overrides))
    message = str(failure.value)
    assert message.startswith(f"{field}: '{missing}'") and f"`{command}`" in message, message
    assert "HF_HUB_OFFLINE" in message and str(hub["cache"]) in message


def test_resolving_never_reaches_for_the_network_when_offline(hub, monkeypatch):
    """A hub id that is not cached fails at once (offline): no download is attempted."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        if not kwargs.get("local_files_only"):
            raise AssertionError("a download was attempted")
        return original(*args, **kwargs)

    original = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(FileNotFoundError, match="model.policy: 'acme/elsewhere'"):
        resolve_model("acme/elsewhere", "model.policy")


def test_the_critic_follows_the_policy_and_a_foreign_one_fails_before_any_weights_load(hub, tmp_path):
    """PPO scored by a function: no reward model to start the critic from, so it starts from the policy. A critic
    or a token-transport reward model with another tokenizer (the tiny ones) fails naming its field."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    function = {"algorithm": "ppo", "reward.source": "function", "reward.function": f"{rewards}:length"}
    assert prepare_run(user_cfg(tmp_path, **function)).model.critic == POLICY
    with pytest.raises(ValueError, match=r"^model.critic: 'tiny/critic' does not share the policy's tokenizer"):
        prepare_run(user_cfg(tmp_path, **function, **{"model.critic": "tiny/critic"}))
    with pytest.raises(ValueError, match=r"^model.reward: 'tiny/reward' does not share the policy's tokenizer.*"
                                         r"reward.transport='tokens'"):
        prepare_run(user_cfg(tmp_path, **{"algorithm": "rloo", "model.reward": "tiny/reward",
                                          "reward.transport": "tokens"}))
    # a reward model of another family reads text; the critic then starts from the policy, not from it
    cfg = prepare_run(user_cfg(tmp_path, **{"algorithm": "ppo", "model.reward": "tiny/reward"}))
    assert cfg.reward.transport == "text" and cfg.model.critic == POLICY
    with pytest.raises(ValueError, match=r"^model.reward: not set, and reward.source='model' needs a reward model"):
        prepare_run(user_cfg(tmp_path))
