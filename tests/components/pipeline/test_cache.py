"""Stage keys, records and the build lease (components/pipeline/cache.py, the provenance record of each stage's job:
components/tracking/provenance.py), on a local store and on a real S3 endpoint (moto's server): each input changes a
key and nothing else does (pure: no training); a record is reused only with its model intact; two processes racing for
one stage build it once; a dead holder's S3 lease is taken over."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import threading
from pathlib import Path

import pytest

from components.pipeline.cache import Records, stage_dir
from components.pipeline.config import PipelineConfig
from components.pipeline.run import job_config
from components.runs import provenance
from components.storage.lease import held
from components.storage.store import CheckpointStore
from components.tracking import provenance as prov
from models.config import merge
from models.data import builtin_rows
from models.deploy import DeployConfig
from models.resolve import pin, resolve_data
from models.tiny_files import EMBEDDED_DIR
from tests.components.pipeline.racer import racer
from tests.hub_cache import put_in_cache

UPSTREAM = {"sft": str(EMBEDDED_DIR / "policy"), "reward_model": str(EMBEDDED_DIR / "reward"),
            "rl": str(EMBEDDED_DIR / "policy"), "dpo": str(EMBEDDED_DIR / "policy")}


def record(stage: str, cfg: PipelineConfig, deploy: DeployConfig | None = None, upstream: dict = UPSTREAM) -> dict:
    """A stage's provenance record, as the pipeline makes it: of its job config, its sources pinned."""
    return provenance(pin(job_config(stage, cfg, deploy or DeployConfig(), upstream, "parent")))


def keys(cfg: PipelineConfig, deploy: DeployConfig | None = None, upstream: dict = UPSTREAM) -> dict[str, str]:
    """Each stage's key (the digest of its job's provenance record), its upstream models given."""
    return {stage: prov.digest(record(stage, cfg, deploy, upstream)) for stage in cfg.stages}


def test_a_pipelines_stage_keys_follow_what_each_stage_is_made_from(tmp_path):
    """Only an RL setting changed: sft and reward_model keep their keys, rl's changes. Only the preference data
    changed: sft keeps its key, reward_model's changes. Name, MLflow, run names, the deployment, the RL stage's
    held-out eval, checkpoints and memory knobs change no key; another upstream model changes the keys after it."""
    cfg = PipelineConfig()
    base = keys(cfg)
    untouched = merge(cfg, {"name": "other", "tracking.experiment": "x", "rl.tracking.parent_run_id": "abc",
                            "rl.run_name": "whatever", "rl.eval.every": 1, "rl.checkpoint.every": 1,
                            "rl.generation.micro_batch_size": 3, "rl.model.gradient_checkpointing": True,
                            "sft.micro_batch_size": 3, "sft.eval_every": 2, "checkpoint.keep_last": 5})
    assert keys(untouched, DeployConfig(state_dir=str(tmp_path), actor={"nproc_per_node": 2})) == base
    rl_only = keys(merge(cfg, {"rl.reinforce.optim.lr": 1e-4}))
    assert (rl_only["sft"], rl_only["reward_model"]) == (base["sft"], base["reward_model"])
    assert rl_only["rl"] != base["rl"]
    rows = builtin_rows("sentiment_preference", "train")[:100]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    new_data = keys(merge(cfg, {"reward_model.data": str(tmp_path / "pairs.jsonl"),
                                "reward_model.eval_data": "builtin:sentiment_preference"}))
    assert new_data["sft"] == base["sft"] and new_data["reward_model"] != base["reward_model"]
    other = keys(cfg, upstream={**UPSTREAM, "sft": str(EMBEDDED_DIR / "critic")})  # another SFT model
    assert other["sft"] == base["sft"] and all(other[s] != base[s] for s in ("reward_model", "rl", "eval"))
    assert keys(cfg, upstream={**UPSTREAM, "rl": str(EMBEDDED_DIR / "critic")})["eval"] != base["eval"]
    assert len(set(base.values())) == 4  # no two stages share a key


def test_a_reward_file_rewritten_in_place_retrains_rl_and_reevaluates_and_reuses_sft(tmp_path):
    """A pipeline whose RL stage is scored by a reward function has no reward-model stage (sft -> rl -> eval) and its
    eval is judged by that function: rewriting the file changes the keys of rl and eval, not sft's."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def score(prompts, responses, **kw):\n    return [float(len(r)) for r in responses]\n")
    cfg = merge(PipelineConfig(), {"rl.reward.source": "function", "rl.reward.function": f"{rewards}:score"})
    before = keys(cfg)
    rewards.write_text("def score(prompts, responses, **kw):\n    return [-float(len(r)) for r in responses]\n")
    after = keys(cfg)  # the same path, other bytes
    assert list(after) == ["sft", "rl", "eval"]
    assert after["sft"] == before["sft"] and after["rl"] != before["rl"] and after["eval"] != before["eval"]
    for stage in ("rl", "eval"):
        made = record(stage, cfg)
        assert made["files"]["reward.0"]["function"] == "score" and str(rewards) not in json.dumps(made)


def test_a_hub_model_at_another_commit_retrains_everything_after_it(tmp_path, monkeypatch):
    """base_model a hub id in the Hugging Face cache: its main branch moved to another commit (other bytes) changes
    the SFT stage's key and, from the base, the reward model's; the record holds the resolved commit."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    first = put_in_cache(EMBEDDED_DIR / "policy", tmp_path / "hub", "org/base")
    cfg = merge(PipelineConfig(), {"base_model": "org/base", "reward_model.init": "base",
                                   "rl.data.prompts": "builtin:sentiment"})
    before = keys(cfg)
    model = record("sft", cfg)["models"]["model"]
    assert (model["source"], model["commit"]) == ("hub", first)
    moved = tmp_path / "moved"
    shutil.copytree(EMBEDDED_DIR / "policy", moved)
    (moved / "generation_config.json").write_text('{"max_length": 7}')  # another commit: other bytes
    second = put_in_cache(moved, tmp_path / "hub", "org/base")
    after = keys(cfg)
    assert second != first and after["sft"] != before["sft"] and after["reward_model"] != before["reward_model"]


def test_a_stages_key_and_its_job_read_the_same_pin_when_the_branch_moves_between(tmp_path, monkeypatch):
    """The pipeline pins a stage's sources once: its key is made from the pins and its job runs with them, so a hub
    branch that moves after the key was made changes neither what the job loads nor what it records."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    first = put_in_cache(EMBEDDED_DIR / "policy", tmp_path / "hub", "org/base")
    job = pin(job_config("sft", merge(PipelineConfig(), {"base_model": "org/base"}), DeployConfig(), UPSTREAM))
    key = prov.digest(provenance(job))
    moved = tmp_path / "moved"
    shutil.copytree(EMBEDDED_DIR / "policy", moved)
    (moved / "generation_config.json").write_text('{"max_length": 7}')
    assert put_in_cache(moved, tmp_path / "hub", "org/base") != first  # main moved on
    assert job.local_path("model").endswith(first) and prov.digest(provenance(pin(job))) == key
    repinned = pin(job.model_copy(update={"sources": type(job.sources)()}))
    assert provenance(repinned)["models"]["model"]["commit"] != first


def test_subset_reaches_the_stage_data_and_a_missing_rl_prompts_is_named(tmp_path):
    folder = tmp_path / "data"
    for subset, label in (("a", "one"), ("b", "two")):
        (folder / subset).mkdir(parents=True)
        (folder / subset / "train.jsonl").write_text(json.dumps({"prompt": label, "completion": "x"}) + "\n")
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: a\n  data_files:\n  - split: train\n    "
                                      "path: a/train.jsonl\n- config_name: b\n  data_files:\n  - split: train\n    "
                                      "path: b/train.jsonl\n---\n")
    digests = {subset: prov.data_record(resolve_data(str(folder), "sft.data", subset=subset), "train")["digest"]
               for subset in ("a", "b")}
    assert digests["a"] != digests["b"]
    with pytest.raises(ValueError,
                       match=r"rl.data.prompts: not set; name the RL stage's prompts .* or rl.preset: tiny"):
        PipelineConfig(base_model="org/x", rl={"algorithm": "rloo"})  # the field defaults: no prompts named


def write_model(records: Records, stage: str, key: str, tmp_path: Path) -> dict:
    local = tmp_path / f"model-{key[:6]}"
    local.mkdir(parents=True)
    (local / "config.json").write_text('{"a": 1}')
    (local / "model.safetensors").write_bytes(b"weights")
    store = records.store(stage, key)
    uri = store.put_dir(local, "model")
    files = store.get_json("model.sha256.json")
    records.write(stage, key, {"model": uri, "files": files, "metrics": {"eval/loss": 1.0}})
    return files


def test_a_record_is_reused_only_with_its_model_intact(tmp_path):
    records = Records((tmp_path / "checkpoints").as_uri())
    key = "1" * 64
    assert records.valid_record("sft", key) is None
    files = write_model(records, "sft", key, tmp_path)
    record = records.valid_record("sft", key)
    assert record["files"] == files and record["key"] == key and record["stage"] == "sft"
    assert (tmp_path / "checkpoints" / stage_dir("sft", key) / "record.json").exists()
    other = "1" * 20 + "2" * 44  # the same directory (first 20 characters), another key: not this record
    assert records.valid_record("sft", other) is None
    (tmp_path / "checkpoints" / stage_dir("sft", key) / "model.sha256.json").write_text('{"config.json": "0"}')
    assert records.valid_record("sft", key) is None  # the stored model is not the one recorded


def race(base_uri: str, endpoint: str | None, tmp_path: Path, env: dict) -> list[dict]:
    key = "9" * 64
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=racer, args=(base_uri, endpoint, key, str(tmp_path / "builds"), str(tmp_path / "log"),
                                              str(tmp_path / f"result{i}"), env, start)) for i in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert len((tmp_path / "builds").read_text().split()) == 1  # built once
    results = [json.loads((tmp_path / f"result{i}").read_text()) for i in range(2)]
    assert sorted(r["reused"] for r in results) == [False, True]
    assert results[0]["metrics"] == results[1]["metrics"]  # the waiter reuses the builder's record
    assert "is building" in (tmp_path / "log").read_text()  # it waited, and said so
    return results


def test_two_pipelines_racing_for_one_stage_build_it_once(tmp_path):
    race((tmp_path / "checkpoints").as_uri(), None, tmp_path, {})


def test_two_pipelines_racing_on_s3_build_it_once(tmp_path, s3_bucket, aws_env):
    endpoint, bucket = s3_bucket
    race(f"s3://{bucket}/pipelines", endpoint, tmp_path, aws_env)


def test_a_live_holders_s3_lease_is_waited_for_until_it_is_released(s3_bucket):
    """A stage's lease held (and renewed past its timeout) by a live pipeline is waited for, the waiter told who
    holds it, and taken once released. (A dead holder's lease, taken over after its timeout: the same lease as a run's,
    tests/components/tracking/test_run_lease.py.)"""
    endpoint, bucket = s3_bucket
    store = CheckpointStore.from_uri(f"s3://{bucket}/locks", s3_endpoint_url=endpoint)
    acquired, waited = threading.Event(), []

    def second() -> None:
        with held(store, "pipeline second", "live", timeout_s=2.0, wait_s=None, poll_s=0.2, waiting=waited.append):
            acquired.set()

    waiter = threading.Thread(target=second)
    with held(store, "pipeline first", "live", timeout_s=2.0):
        waiter.start()
        assert not acquired.wait(4.0)  # the holder's renewals keep its lease past its timeout
    waiter.join(timeout=20)
    assert acquired.is_set() and [h.name for h in waited] == ["pipeline first"]  # released: the waiter has it


def test_a_model_on_s3_is_fetched_once_and_checked(tmp_path, s3_bucket):
    """A record whose model lives on S3 (a pipeline on another pod built it): fetched into the state directory with
    every file's sha256 checked against the record, kept for the next use; a stored model that is not the recorded
    one is refused."""
    from components.pipeline.run import PipelineError, local_model

    endpoint, bucket = s3_bucket
    records = Records(f"s3://{bucket}/pipelines", endpoint)
    key = "7" * 64
    files = write_model(records, "reward_model", key, tmp_path)
    record = records.valid_record("reward_model", key)
    p = type("P", (), {"records": records, "state_dir": tmp_path / "state"})()
    path = Path(local_model(p, "reward_model", record))
    assert path.is_relative_to(tmp_path / "state") and (path / "model.safetensors").read_bytes() == b"weights"
    assert local_model(p, "reward_model", record) == str(path)  # already here: kept
    with pytest.raises(PipelineError, match=r"reward_model: the model at s3://.* is not the one recorded"):
        local_model(p, "reward_model", {**record, "files": {**files, "config.json": "0" * 64}})
