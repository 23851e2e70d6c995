"""The one resolver (models/resolve.py) for what lives on this machine: the embedded tiny models, a local directory
and a user's model by its hub id, loaded from the Hugging Face cache with no network (a small Qwen2 model with its own
BPE tokenizer and chat template, laid out in a temporary HF_HUB_CACHE as huggingface_hub lays it out), at
model.revision; a missing one fails naming the field, the id and the command that fetches it, and is downloaded
only where the deployment allows it, by one process while the others wait. Every record carries the digest of its
files (checked here against hashlib over the bytes) and, for the hub, the commit it resolved to. A hub data set
resolves the same way, at its revision and subset. A job pins what it reads once (models/resolve.pin): a field asking
what another's pin holds shares it, a config that carries its pins (what the ranks, servers and node groups receive)
resolves nothing again and loads where the resolver could not, a pinned file that changed fails naming its field,
and a pin whose path is not on this machine is found by its pinned commit. And what prepare_run decides about the
models a user did not give: the critic and a token-transport reward model must read the policy's tokens, checked
before any weights load. s3:// sources: tests/components/storage/test_sources.py."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import pytest
import torch

from models import resolve
from models.config import RLHFConfig, merge, preset
from models.data import DataError, read_rows
from models.deploy import DeployConfig
from models.prepare import prepare_run
from models.resolve import pin, resolve_data, resolve_model
from models.tiny_files import EMBEDDED_DIR
from tests.hub_cache import build_qwen2, put_in_cache

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

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
    snapshot = cfg.local_path("model.policy")
    assert snapshot == str(hub["cache"] / "models--acme--tiny-qwen" / "snapshots" / hub["main"])
    tokenizer = load_policy_tokenizer(snapshot)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "2 plus 3?"}], add_generation_prompt=True, tokenize=False)
    policy = Policy.load(snapshot)
    expected = weights(AutoModelForCausalLM.from_pretrained(hub["root"] / "policy"))
    got = weights(policy.model)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    reward = load_reward_model(cfg.local_path("model.reward"))
    assert type(reward).__name__ == "Qwen2ForSequenceClassification"
    assert cfg.model.critic is None  # the reward model shares the policy's tokenizer: the critic starts from it
    critic = init_critic(None, cfg.local_path("model.reward"))
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert cfg.reward.transport == "tokens"


def test_model_revision_picks_a_branch_or_commit_of_the_policy_id(hub, tmp_path):
    v2 = pin(user_cfg(tmp_path, **{"model.revision": "v2"}))
    assert v2.local_path("model.policy").endswith(hub["v2"])
    assert pin(user_cfg(tmp_path, **{"model.revision": hub["main"]})).local_path("model.policy").endswith(hub["main"])
    # the policy's revision applies to another field naming the same id, not to another id
    same = pin(user_cfg(tmp_path, **{"model.revision": "v2", "model.critic": POLICY, "model.reward": REWARD}))
    assert same.local_path("model.critic").endswith(hub["v2"])
    assert "models--acme--tiny-qwen-rm" in same.local_path("model.reward")


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


def test_without_hf_hub_offline_the_deployment_still_downloads_nothing_unless_it_allows_it(hub, monkeypatch):
    """The offline default is the deployment's (deploy.cache.hub_downloads=false), not only HF_HUB_OFFLINE's: a
    missing id fails naming the field, the setting and the command, and no download is attempted."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    original = huggingface_hub.snapshot_download

    def refuse(*args, **kwargs):
        if not kwargs.get("local_files_only"):
            raise AssertionError("a download was attempted")
        return original(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(FileNotFoundError) as failure:
        resolve_model("acme/not-cached", "model.policy")
    assert "deploy.cache.hub_downloads=false" in str(failure.value)
    assert "`hf download acme/not-cached`" in str(failure.value)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):  # the environment forbids it either way
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        resolve_model("acme/not-cached", "model.policy", deploy=DeployConfig(cache={"hub_downloads": True}))


def test_where_downloads_are_allowed_one_process_downloads_and_the_others_wait_for_it(hub, monkeypatch, tmp_path):
    """deploy.cache.hub_downloads=true (the cluster: one cache on the pods' shared volume): two resolvers of a
    missing id at once download it once, under the lock in the cache; the second waits for the first and finds it
    there. The hub is out of reach here, so its download is stood in for by laying the files out in the cache as it
    would (a test must never download)."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    original, downloads, release = huggingface_hub.snapshot_download, [], threading.Event()
    source = build_qwen2(tmp_path / "fresh", seed=3)

    def fake_hub(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return original(repo_id, **kwargs)
        downloads.append(repo_id)
        release.wait(60)  # the first download is in flight until the second resolver is started
        commit = put_in_cache(source, Path(kwargs["cache_dir"]), repo_id)
        return str(Path(kwargs["cache_dir"]) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    allowed = DeployConfig(cache={"hub_downloads": True})
    found = {}

    def resolve(name):
        found[name] = resolve_model("acme/fresh", "model.policy", deploy=allowed)

    first = threading.Thread(target=resolve, args=("first",))
    first.start()
    assert wait_until(lambda: downloads), "the first resolver never started its download"
    second = threading.Thread(target=resolve, args=("second",))
    second.start()
    second.join(1.0)
    assert second.is_alive(), "the second resolver did not wait for the first one's download"
    release.set()
    first.join(60)
    second.join(60)
    assert downloads == ["acme/fresh"]  # once, by one of them
    assert found["first"].path == found["second"].path and found["first"].provenance["source"] == "hub"
    assert found["second"].digest == digest_of(source)


def test_tiny_local_and_hub_records_carry_the_digest_of_their_bytes(hub, tmp_path):
    """The digest is sha256 over each file's relative path and the sha256 of its bytes (recomputed here with
    hashlib), the same for the same bytes whatever the source; it follows a changed file; a hub record names the
    commit it resolved to, not only the id."""
    tiny = resolve_model("tiny/policy", "model.policy")
    assert tiny.source == "tiny" and tiny.path == str(EMBEDDED_DIR / "policy")
    assert tiny.digest == digest_of(EMBEDDED_DIR / "policy")
    copy = tmp_path / "my-policy"
    shutil.copytree(EMBEDDED_DIR / "policy", copy)
    local = resolve_model(str(copy), "model.policy")
    assert local.source == "local" and local.path == str(copy) and local.digest == tiny.digest
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert resolve_model(str(copy), "model.policy").digest == digest_of(copy) != tiny.digest
    main, v2 = (resolve_model(POLICY, "model.policy", revision) for revision in (None, "v2"))
    assert main.provenance == {"source": "hub", "value": POLICY, "repo": POLICY, "repo_type": "model",
                               "revision": None, "commit": hub["main"], "digest": digest_of(hub["root"] / "policy")}
    assert v2.provenance["commit"] == hub["v2"] and v2.digest == digest_of(hub["root"] / "policy-v2") != main.digest
    with pytest.raises(FileNotFoundError, match="^model.critic: model path './nowhere' does not exist"):
        resolve_model("./nowhere", "model.critic")
    with pytest.raises(ValueError, match="^model.policy: 's3://b/m' is an s3:// prefix; a revision"):
        resolve_model("s3://b/m", "model.policy", "v2")


def test_a_hub_data_set_is_read_at_its_revision_and_subset_from_the_cache(hub, tmp_path):
    """data.prompts as a hub id: its snapshot in the cache, at data.revision, read as the hub lays it out (its
    README's configurations: data.subset); a missing one names the field and the `hf download --repo-type dataset`
    command; a revision of a source that is no hub id is refused, naming the field."""
    import datasets

    for branch, rows in (("main", [{"question": "1 + 1?"}, {"question": "2 + 2?"}]), ("v2", [{"question": "3 + 3?"}])):
        folder = tmp_path / branch
        for name in ("main", "socratic"):
            (folder / name).mkdir(parents=True)
            datasets.Dataset.from_list([{"question": f"{r['question']} ({name})"} for r in rows]).to_json(
                str(folder / name / "train.jsonl"))
        (folder / "README.md").write_text(
            "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
            "- config_name: socratic\n  data_files:\n  - split: train\n    path: socratic/train.jsonl\n---\n")
        put_in_cache(folder, hub["cache"], "acme/math", branch, repo_type="dataset")
    main = resolve_data("acme/math", "data.prompts", subset="main")
    assert read_rows(main, "train")["question"] == ["1 + 1? (main)", "2 + 2? (main)"]
    found = resolve_data("acme/math", "data.prompts", "v2", subset="socratic")
    assert read_rows(found, "train")["question"] == ["3 + 3? (socratic)"]
    assert found.provenance["repo_type"] == "dataset" and found.provenance["subset"] == "socratic"
    assert found.provenance["commit"] != resolve_data("acme/math", "data.prompts").provenance["commit"]
    with pytest.raises(FileNotFoundError,
                       match=r"^data.prompts: 'acme/other' .*`hf download acme/other --repo-type dataset`"):
        resolve_data("acme/other")
    with pytest.raises(DataError, match=r"^eval.revision: 'builtin:sentiment' is no hub data set id"):
        read_rows(resolve_data("builtin:sentiment", "eval.prompts", "v2"), "test")


def digest_of(directory: Path) -> str:
    """sha256 over every file's relative path and the sha256 of its bytes (hashlib, independently of the code)."""
    files = sorted((p.relative_to(directory).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
                   for p in Path(directory).rglob("*") if p.is_file())
    return hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in files).encode()).hexdigest()


def wait_until(condition, timeout: float = 60.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout * 20)):
        if condition():
            return True
        done.wait(0.05)
    return False


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


@pytest.fixture
def counted(monkeypatch) -> list[str]:
    """The hub ids the resolver resolves in this process (what a pin costs: a cache lookup, a download)."""
    seen, original = [], resolve.resolve_hub

    def counting(repo_id, *args, **kwargs):
        seen.append(repo_id)
        return original(repo_id, *args, **kwargs)

    monkeypatch.setattr(resolve, "resolve_hub", counting)
    return seen


def test_a_job_resolves_each_source_once_and_what_it_hands_on_resolves_nothing(hub, tmp_path, counted):
    """Preparing a run pins each model once: the critic initialised from the policy shares the policy's pin. The
    prepared config, as its ranks, servers and node groups receive it (JSON), prepares again without resolving, and
    the paths it gives are the pins' (the snapshot of the commit recorded)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    cfg = prepare_run(user_cfg(tmp_path, **{"algorithm": "ppo", "reward.source": "function",
                                            "reward.function": f"{rewards}:length"}))
    assert counted == [POLICY] and cfg.model.critic == POLICY
    policy, critic = cfg.source("model.policy"), cfg.source("model.critic")
    assert critic.path == policy.path and critic.files == policy.files and critic.details["commit"] == hub["main"]
    received = RLHFConfig.model_validate_json(cfg.model_dump_json())
    assert prepare_run(received) == received and counted == [POLICY]
    snapshot = hub["cache"] / "models--acme--tiny-qwen" / "snapshots" / hub["main"]
    assert received.local_path("model.critic") == str(snapshot)


def test_a_pinned_config_loads_where_the_resolver_could_not(hub, tmp_path, monkeypatch):
    """A process given the pinned config reads the pinned snapshot even where the hub cache it would resolve in is
    empty: it never resolves the id."""
    from models.policy import load_policy_tokenizer

    cfg = pin(user_cfg(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=f"model.policy: '{POLICY}'"):
        resolve_model(POLICY, "model.policy")
    assert load_policy_tokenizer(cfg.local_path("model.policy")).chat_template


def test_a_pinned_file_that_changed_or_a_value_that_moved_on_fails_naming_the_field(tmp_path):
    """A local model rewritten after the job pinned it is refused (its sha256 differs), and so is a config whose
    field names another value than its pin: nothing is resolved again behind the record's back."""
    copy = tmp_path / "my-policy"
    shutil.copytree(EMBEDDED_DIR / "policy", copy)
    cfg = pin(preset("tiny", **{"deploy.state_dir": str(tmp_path), "model.policy": str(copy)}))
    assert cfg.local_path("model.policy") == str(copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"^model.policy: .* changed since the job pinned it: \['config.json'\]"):
        cfg.local_path("model.policy")
    moved = merge(cfg, {"model.policy": "tiny/policy"})
    with pytest.raises(RuntimeError, match=r"^model.policy: 'tiny/policy' is not pinned"):
        moved.local_path("model.policy")


def test_a_pin_whose_path_is_elsewhere_is_found_here_by_what_it_pinned(hub, tmp_path, monkeypatch):
    """Another node without the job's shared cache: a hub pin is found at its pinned commit in this machine's cache
    (not at the branch, which moved), an embedded one in this package; each checked against the pinned digests."""
    cfg = pin(user_cfg(tmp_path, **{"model.reward": "tiny/reward"}))
    elsewhere = tmp_path / "other-cache"
    shutil.copytree(hub["cache"], elsewhere, symlinks=True)
    put_in_cache(build_qwen2(tmp_path / "moved", seed=5), elsewhere, POLICY)  # main moved on here
    pins = cfg.sources.model_copy(deep=True)
    pins.models["model.policy"].path = str(tmp_path / "gone" / hub["main"])
    pins.models["model.reward"].path = str(tmp_path / "gone" / "reward")
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    moved = cfg.model_copy(update={"sources": pins})
    assert moved.local_path("model.policy") == str(elsewhere / "models--acme--tiny-qwen" / "snapshots" / hub["main"])
    assert moved.local_path("model.reward") == str(EMBEDDED_DIR / "reward")
