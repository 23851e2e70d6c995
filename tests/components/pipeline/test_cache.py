"""Stage keys, records and the build lock (components/pipeline/cache.py, run.py's key inputs), on a local store and
on a real S3 endpoint (moto's server): each input changes a key and nothing else does; a record is reused only with
its model intact; two processes racing for one stage build it once; a dead holder's S3 lock is taken over."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from components.pipeline.cache import Records, stage_dir, stage_key
from components.pipeline.config import PipelineConfig
from components.pipeline.run import eval_inputs, reward_model_inputs, rl_inputs, sft_inputs
from components.storage.store import CheckpointStore
from models.config import merge
from models.data import builtin_rows
from tests.components.pipeline.racer import racer

INPUTS = {"config": {"sft": {"optim": {"lr": 1e-3}, "epochs": 1}, "seed": 0}, "data": {"train": "a" * 64},
          "upstream": {"base_model": "b" * 64}, "code": "c" * 64}


def key_of(**changes) -> str:
    inputs = {**INPUTS, **changes}
    return stage_key(changes.get("stage", "sft"), inputs["config"], inputs["data"], inputs["upstream"], inputs["code"])


def test_each_input_changes_the_key_and_nothing_else_does():
    base = key_of()
    changed = [key_of(stage="reward_model"), key_of(config={**INPUTS["config"], "seed": 1}),
               key_of(config={**INPUTS["config"], "sft": {"optim": {"lr": 2e-3}, "epochs": 1}}),
               key_of(data={"train": "d" * 64}), key_of(data={**INPUTS["data"], "eval": "e" * 64}),
               key_of(upstream={"base_model": "f" * 64}), key_of(code="0" * 64)]
    assert len({base, *changed}) == len(changed) + 1
    reordered = {"seed": 0, "sft": {"epochs": 1, "optim": {"lr": 1e-3}}}  # the same config, keys in another order
    assert key_of(config=reordered) == base


def test_a_pipelines_stage_keys_follow_what_each_stage_is_made_from(tmp_path):
    """Only an RL setting changed: sft and reward_model keep their inputs, rl's change. Only the preference data
    changed: sft keeps them, reward_model's change (and with its model, rl's). Name, eval and deployment touch no
    stage before eval."""
    cfg = PipelineConfig()
    base = {"sft": sft_inputs(cfg), "reward_model": reward_model_inputs(cfg, "s" * 64),
            "rl": rl_inputs(cfg, "s" * 64, "r" * 64)}

    def inputs(other: PipelineConfig) -> dict:
        return {"sft": sft_inputs(other), "reward_model": reward_model_inputs(other, "s" * 64),
                "rl": rl_inputs(other, "s" * 64, "r" * 64)}

    renamed = inputs(merge(cfg, {"name": "other", "eval.max_prompts": 3, "tracking.experiment": "x",
                                 "rl.tracking.parent_run_id": "abc", "rl.run_name": "whatever"}))
    assert renamed == base
    rl_only = inputs(merge(cfg, {"rl.reinforce.optim.lr": 1e-4}))
    assert rl_only["sft"] == base["sft"] and rl_only["reward_model"] == base["reward_model"]
    assert rl_only["rl"] != base["rl"]
    rows = builtin_rows("sentiment_preference", "train")[:100]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    new_data = inputs(merge(cfg, {"reward_model.data": str(tmp_path / "pairs.jsonl"),
                                  "reward_model.eval_data": "builtin:sentiment_preference"}))
    assert new_data["sft"] == base["sft"] and new_data["reward_model"][1] != base["reward_model"][1]
    assert new_data["reward_model"][1]["eval"] == base["reward_model"][1]["eval"]  # the held-out rows are the same
    assert reward_model_inputs(cfg, "t" * 64)[2] != base["reward_model"][2]  # another SFT model, another reward model
    assert rl_inputs(cfg, "s" * 64, "u" * 64)[2] != base["rl"][2]
    assert eval_inputs(cfg, "p" * 64, "s" * 64, "r" * 64) != eval_inputs(cfg, "q" * 64, "s" * 64, "r" * 64)


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


def test_a_dead_holders_s3_lock_is_taken_over(s3_bucket):
    """A lock nobody rewrote for stale_s (its holder died) is taken by one waiter; a live holder's is not."""
    endpoint, bucket = s3_bucket
    store = CheckpointStore.from_uri(f"s3://{bucket}/locks", s3_endpoint_url=endpoint)
    store.put_json("held", {"pipeline": "dead"})
    waited = []
    started = time.monotonic()
    with store.exclusive("held", {"pipeline": "me"}, waiting=waited.append, poll_s=0.2, stale_s=2.0):
        assert store.get_json("held") == {"pipeline": "me"}
        assert time.monotonic() - started >= 1.0  # not taken at once: it was fresh when first seen
    assert waited == [{"pipeline": "dead"}]
    assert store.get_json("held") is None  # released
    acquired = threading.Event()

    def second() -> None:
        with store.exclusive("live", {"pipeline": "second"}, poll_s=0.2, stale_s=2.0):
            acquired.set()

    waiter = threading.Thread(target=second)
    with store.exclusive("live", {"pipeline": "first"}, poll_s=0.2, stale_s=2.0):
        waiter.start()
        assert not acquired.wait(4.0)  # the holder's heartbeat keeps its lock fresh past stale_s
    waiter.join(timeout=20)
    assert acquired.is_set()  # released: the waiter has it


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
