"""The stages as jobs of the one job builder (components/runs.py) on real ranks, a real MLflow store and checkpoint
store: resume where a run stopped, falling back past a corrupted latest checkpoint; two ranks (gloo, FSDP2) against
one on the same data; the reward model's output (statistics, hand-off as the RL stage loads it); a LoRA stage's merged
output; and a reward model without its score head refused naming the weight."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from components.export import export_checkpoint
from components.jobs.stages import stage_rows
from components.runs import train as train_stage
from components.storage.store import CheckpointStore
from models.critic import init_critic
from models.resolve import file_digests, pin, resolve_model
from models.reward import HandOffError, load_reward_model, reward_model_scores
from models.stages.config import RewardModelRun, SFTRun
from models.stages.data import right_padded
from models.loop import Steps
from models.metrics import find
from models.stages.evaluate import check_reward_model
from models.tiny_files import EMBEDDED_DIR
from tests.hub_cache import put_in_cache


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """The module's state directory: one MLflow store and checkpoint store for its runs (each its own run name)."""
    return tmp_path_factory.mktemp("stages")


def stage_config(kind, tmp_path, **fields):
    base = {"deploy": {"state_dir": str(tmp_path), "tracking": {"system_metrics": False}}, "checkpoint": {"every": 2}}
    section = {"batch_size": 8, "micro_batch_size": 3, "max_eval_rows": 24, **fields.pop("section", {})}
    name = "sft" if kind is SFTRun else "reward_model"
    return kind.model_validate({**base, **fields, name: section})


class Said(Steps):
    """The steps of a job run here, its messages kept."""

    def __init__(self):
        self.messages: list[str] = []

    def log(self, message: str) -> None:
        self.messages.append(message)


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst <= atol, worst


def test_a_stage_resumes_where_it_stopped_falling_back_past_a_corrupted_checkpoint(state):
    """3 steps (checkpoints at 2 and 3), stopped; the latest checkpoint corrupted; resumed to 4 under the same name:
    it falls back to step 2, saying so, and ends with the steps, the rows and the weights of a straight run of 4
    (float32 tolerance: another run of the same kernels)."""
    straight = train_stage(stage_config(SFTRun, state, run_name="straight", section={"max_steps": 4}))
    first = train_stage(stage_config(SFTRun, state, run_name="resumed", section={"max_steps": 3}))
    store = state / "checkpoints" / "resumed"
    latest = json.loads((store / "latest.json").read_text())
    assert latest["iteration"] == 3
    (store / latest["path"] / "trainee" / "model.safetensors").write_bytes(b"corrupted")
    said = Said()
    second = train_stage(stage_config(SFTRun, state, run_name="resumed", section={"max_steps": 4}), said)
    assert any("fails its sha256 check" in m and "falling back" in m for m in said.messages), said.messages
    assert any("resuming from checkpoint step 2" in m for m in said.messages), said.messages
    assert [m["step"] for m in first["history"]] == [1, 2, 3] and [m["step"] for m in second["history"]] == [3, 4]
    assert second["mlflow_run_id"] == first["mlflow_run_id"]  # the same MLflow run goes on
    assert [e["step"] for e in second["evals"]] == [4]  # the eval at 0 was the first attempt's
    assert second["metrics"]["rows"] == straight["metrics"]["rows"] == 32
    assert_close(weights(state / "runs/resumed/model"), weights(state / "runs/straight/model"), atol=1e-6)
    assert second["history"][-1]["train/loss"] == pytest.approx(straight["history"][-1]["train/loss"], rel=1e-5)


# weights whose exact gradient under the Bradley-Terry loss is 0 (it sees score differences, and these only shift
# every score, or every attention logit of a query, alike): their float gradient is rounding noise, which AdamW
# scales up to steps of ~lr, so two runs differ there by ~lr whatever the world size
SHIFT_INVARIANT = ("transformer.ln_f.bias", "attn.c_attn.bias")


def test_two_ranks_train_the_reward_model_like_one_and_its_output_carries_its_statistics(state):
    """A reward model on 2 ranks (FSDP2 shards, gloo) and on 1, same pairs, micro-batches that split each rank's pairs
    unevenly: every step's loss, accuracy and grad norm to 1e-6 (a gradient averaged instead of summed over ranks
    would halve the norm), the weights to 2e-5 (float32 sums in another order; see SHIFT_INVARIANT), the held-out
    metrics of the sharded eval alike. The output carries the scores' statistics and loads as the RL stage loads
    it: rescored as saved, it matches the accuracy its stage recorded; normalized, its scores have mean 0 and std 1."""
    cfg = stage_config(RewardModelRun, state, run_name="one", section={"max_steps": 3})
    one = train_stage(cfg)
    two = train_stage(stage_config(RewardModelRun, state, run_name="two", section={"max_steps": 3},
                                   deploy={"state_dir": str(state), "tracking": {"system_metrics": False},
                                           "actor": {"nproc_per_node": 2}}))
    logged = {name for m in one["history"] + one["evals"] for name in m} | set(one["metrics"])
    assert [name for name in logged if find(name, "reward_model") is None] == []  # docs/metrics.md lists them
    for a, b in zip(one["history"], two["history"], strict=True):
        for name in ("train/loss", "train/accuracy", "train/grad_norm", "train/margin"):
            assert b[name] == pytest.approx(a[name], rel=1e-6, abs=1e-7), (name, a["step"])
    mine, theirs = weights(state / "runs/two/model"), weights(state / "runs/one/model")
    kept = [k for k in mine if not k.endswith(SHIFT_INVARIANT)]
    assert_close({k: mine[k] for k in kept}, {k: theirs[k] for k in kept}, atol=2e-5)
    for name in ("eval/accuracy", "eval/margin", "eval/loss"):
        assert two["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-4, abs=1e-6), name
    # the scores' mean sits near 0, where a relative bound means nothing: with the weights 2e-5 apart, the scores'
    # statistics agree to 1e-4 on the reward's own scale (seen: 1.1e-5 apart on a mean of -0.081)
    for name in ("reward_mean", "reward_std"):
        assert two["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-4, abs=1e-4), name

    # the output (the 1-rank run's) carries its statistics and loads as the RL stage loads it
    model_dir = state / "runs/one/model"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["reward_mean"], config["reward_std"]) == (one["metrics"]["reward_mean"],
                                                             one["metrics"]["reward_std"])
    assert one["model"].endswith("/checkpoints/one/model") and one["files"]["config.json"]
    _, pairs = stage_rows(pin(cfg), str(model_dir), held_out_only=True)
    assert check_reward_model(str(model_dir), pairs, one["metrics"]["eval/accuracy"], "one") == pytest.approx(
        one["metrics"]["eval/accuracy"], abs=1 / len(pairs))
    normalized = load_reward_model(str(model_dir), normalize=True)
    tokens, lengths = right_padded(pairs.chosen + pairs.rejected, 0)
    scores = reward_model_scores(normalized, tokens, lengths).double()
    assert float(scores.mean()) == pytest.approx(0.0, abs=1e-4) and float(scores.std()) == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(HandOffError, match=r"more than|scores .* right as loaded, its stage recorded"):
        check_reward_model(str(model_dir), pairs, one["metrics"]["eval/accuracy"] - 0.25, "one")


def test_a_reward_model_without_its_score_head_is_refused_naming_it(tmp_path, tiny_models):
    """A causal LM's checkpoint given as the reward model (what TRL #1379 and OpenRLHF #643 report going wrong):
    transformers would initialise score.weight at random and only warn; the reward model and the critic built from
    it are refused, naming the weight."""
    with pytest.raises(HandOffError, match=r"model.reward: reward model '.*policy' loads with newly initialised "
                                           r"weights \['score.weight'\]"):
        load_reward_model(tiny_models["policy"])
    with pytest.raises(HandOffError, match=r"\['score.weight'\]"):
        init_critic(None, tiny_models["policy"])
    with pytest.raises(ValueError, match=r"reward.normalize needs the reward statistics \['reward_mean', "
                                         r"'reward_std'\] in the config.json of '.*reward'"):
        load_reward_model(tiny_models["reward"], normalize=True)


def test_a_lora_stage_exports_its_adapters_merged(state, tiny_models):
    """SFT with LoRA: the output is a plain causal LM (no peft needed to load it), the base weights moved only where
    adapters were, the checkpoints hold the adapter alone. One export: the stage's model is its last checkpoint
    exported as `rlhf export` exports it, the same bytes, merged onto the base whose digest the run recorded."""
    result = train_stage(stage_config(SFTRun, state, run_name="lora",
                                      section={"max_steps": 2, "lora": {"enabled": True, "r": 4},
                                               "optim": {"lr": 1e-2}}))
    merged = AutoModelForCausalLM.from_pretrained(state / "runs/lora/model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).state_dict()
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    assert moved and all(k.endswith("c_attn.weight") for k in moved)  # peft's default GPT-2 target
    store = state / "checkpoints" / "lora"
    latest = json.loads((store / "latest.json").read_text())  # its fresh prefix, iter_2-<id>
    assert latest["iteration"] == 2 and (store / latest["path"] / "trainee" / "adapter_model.safetensors").exists()
    assert result["steps"] == 2
    manifest = json.loads((store / latest["path"] / "state.json").read_text())["state"]
    assert (manifest["export"]["base"]["digest"] == resolve_model("tiny/policy").digest
            == manifest["models"]["model"]["digest"])
    out, iteration = export_checkpoint(CheckpointStore.from_uri(str(store)), state / "exported")
    assert iteration == 2 and file_digests(out) == result["files"]


def test_kto_on_two_ranks_trains_like_one_and_learns_the_preference(state):
    """KTO (models/stages/kto.py) on the shipped preference pairs, unpaired: on 2 ranks (FSDP2 shards, gloo) and on
    1, uneven micro-batches, every step's loss to 1e-6 and KL term to 1e-5 (the KL term is the global batch's on any
    number of ranks) and the held-out metrics alike; what it logs is listed (docs/metrics.md). Trained longer, the
    held-out implicit reward ranks desirable above undesirable completions (margin 0 before the first step: the policy
    is its reference) and the held-out loss falls below the untrained one."""
    from models.stages.kto import KTORun

    def config(name, steps, **deploy):
        return KTORun.model_validate({
            "run_name": name, "checkpoint": {"every": 50},
            "deploy": {"state_dir": str(state), "tracking": {"system_metrics": False}, **deploy},
            "kto": {"max_steps": steps, "batch_size": 8, "micro_batch_size": 3, "max_eval_rows": 24}})

    one = train_stage(config("kto-one", 3))
    two = train_stage(config("kto-two", 3, actor={"nproc_per_node": 2}))
    logged = {name for m in one["history"] + one["evals"] for name in m} | set(one["metrics"])
    assert [name for name in logged if find(name, "kto") is None] == []
    for a, b in zip(one["history"], two["history"], strict=True):
        for name in ("train/loss", "train/grad_norm"):
            assert b[name] == pytest.approx(a[name], rel=1e-6, abs=1e-7), (name, a["step"])
        # the KL term is a difference of float32 sums of ~30 nats (an ulp ~2e-6) after weights 1e-6 apart
        assert b["train/kl"] == pytest.approx(a["train/kl"], abs=1e-5), a["step"]
    for name in ("eval/loss", "eval/rewards/margins", "eval/kl"):
        assert two["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-4, abs=1e-6), name

    run = train_stage(KTORun.model_validate({
        "run_name": "kto-learns", "checkpoint": {"every": 50},
        "deploy": {"state_dir": str(state), "tracking": {"system_metrics": False}},
        "kto": {"max_steps": 16, "batch_size": 32, "micro_batch_size": 32, "max_eval_rows": 200}}))
    before, after = run["evals"][0], run["evals"][-1]
    assert before["eval/rewards/margins"] == 0 and before["eval/loss"] == pytest.approx(0.5, abs=1e-6)
    assert after["eval/rewards/margins"] > 0 and after["eval/loss"] < before["eval/loss"], after


def test_a_job_given_its_pins_runs_on_its_ranks_with_what_it_was_resolved_from_out_of_reach(state, tmp_path,
                                                                                             monkeypatch):
    """Sources are resolved once, where a job starts: an SFT run of a hub model, pinned first, runs on two ranks
    (rank 0 and a follower it starts) and publishes its model with the Hugging Face cache it was resolved from
    hidden from every process: none of them resolves the id again. What it records is the pinned commit."""
    commit = put_in_cache(EMBEDDED_DIR / "policy", tmp_path / "hub", "org/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = pin(stage_config(SFTRun, state, run_name="pinned", model="org/tiny", section={"max_steps": 2},
                           deploy={"state_dir": str(state), "tracking": {"system_metrics": False},
                                   "actor": {"nproc_per_node": 2}}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # every process started from here on
    with pytest.raises(FileNotFoundError, match="^model: 'org/tiny' is not in the Hugging Face cache"):
        resolve_model("org/tiny", "model")
    result = train_stage(cfg)
    assert result["steps"] == 2 and result["models"]["model"]["commit"] == commit
    assert result["provenance"]["models"]["model"] == {"source": "hub", "digest": resolve_model("tiny/policy").digest,
                                                       "revision": None, "commit": commit}
