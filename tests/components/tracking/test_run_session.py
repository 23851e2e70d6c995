"""A run's checkpoints on S3 (moto server) and tracking in MLflow (sqlite): resume gives the identical model and
continues the same MLflow run, and the next iteration after resume equals the one the uninterrupted run computes. The
run's policy is a model on S3 too (stored as a run stores its model): fetched into the machine's cache, checked by
digest, it trains, and the run's record names where it came from (its ETags and the digest of its files)."""

import json
import uuid
from pathlib import Path

import pytest
import torch

from components.jobs.rl import checkpoint, restore_actor
from components.runs import JOBS, open_session
from components.storage.store import CheckpointStore
from models.backends import LocalCritic
from models.config import preset
from models.algorithms import Backends
from models.metrics import find
from models.loop import Leader, build_actor, build_critic_trainer, gold_function, load_prompts, prompt_batches
from models.prepare import prepare_run
from models.resolve import resolve_model
from models.step import train_step
from tests.components.conftest import AWS_ENV

NON_DETERMINISTIC = ("time/", "throughput/", "step_time")


@pytest.fixture(scope="module")
def cfg(tiny_models, tmp_path_factory, moto_endpoint):
    """The module's runs' config (each test its own run name): one bucket on the moto server holding the policy and
    the checkpoints, one MLflow store, one state directory; dummy credentials and no endpoint from the shell."""
    import boto3

    tmp_path = tmp_path_factory.mktemp("run-session")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL", "AWS_PROFILE",
                     "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        bucket = f"test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        CheckpointStore.from_uri(f"s3://{bucket}/models", s3_endpoint_url=moto_endpoint).put_dir(
            Path(tiny_models["policy"]), "policy")
        yield prepare_run(preset("tiny", **{
            "deploy.state_dir": str(tmp_path / "state"), "model.policy": f"s3://{bucket}/models/policy",
            "deploy.cache.dir": str(tmp_path / "cache"),
            "model.reward": tiny_models["reward"], "run_name": "resume-me", "algorithm": "ppo",
            "deploy.checkpoint.uri": f"s3://{bucket}/ckpt", "deploy.checkpoint.s3_endpoint_url": moto_endpoint,
            "deploy.tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "deploy.tracking.system_metrics": False,
            "ppo.rollout_batch_size": 16, "ppo.minibatch_size": 8}))


def fixed_input(policy):
    ids = policy.encode_prompts(["review the cat : the cat is very good and i love the cat ."])[0]
    return torch.tensor([ids]), torch.tensor([len(ids)])


def clone(tree):
    """A deep copy of a (nested) state dict, tensors included."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone(v) for v in tree)
    return tree


def assert_bitwise(actual, expected, what: str, path: str = "") -> None:
    """Same structure, same dtypes, bit-identical tensors (restored state, not recomputed output)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, f"{what}{path}: dtype differs"
        assert torch.equal(actual, expected), f"{what}{path}: not bitwise equal"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}{path}: keys differ"
        for k in expected:
            assert_bitwise(actual[k], expected[k], what, f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, what, f"{path}[{i}]")
    else:
        assert actual == expected, f"{what}{path}: {actual!r} != {expected!r}"


def run_iterations(cfg, session, state, critic, n):
    backends = Backends(critic=critic.backend if hasattr(critic, "backend") else critic)
    batches = prompt_batches(load_prompts(cfg), cfg.ppo.rollout_batch_size, cfg.seed, start_batch=state.iteration)
    out = []
    for _ in range(n):
        metrics, samples = train_step(state, next(batches), cfg, backends, gold_function(cfg))
        session.log_steps([(state.iteration, metrics)])
        out.append(metrics)
    return out


def test_s3_checkpoint_resume_is_exact_and_continues_the_mlflow_run(cfg):
    session = open_session(JOBS["rl"], cfg)
    assert session.resumed_from is None and session.store.uri.startswith("s3://")
    policy = session.models["model.policy"]  # fetched from S3, the same bytes as the tiny policy
    assert policy["source"] == "s3" and policy["uri"] == cfg.model.policy and set(policy["etags"]) >= {"config.json"}
    assert policy["digest"] == resolve_model("tiny/policy").digest and policy == cfg.source("model.policy").provenance
    assert cfg.local_path("model.policy").startswith(str(Path(cfg.deploy.cache.dir) / "s3"))
    run = session.tracker.client.get_run(session.tracker.run_id)
    assert run.data.tags["model.policy.digest"] == policy["digest"]
    assert session.data == {"data.prompts": {"source": "builtin", "value": "builtin:sentiment", "digest": None}}
    state = build_actor(cfg)
    critic = LocalCritic(build_critic_trainer(cfg, checkpoint_dir=session.critic_dir))
    run_iterations(cfg, session, state, critic, 2)
    uri = checkpoint(session, Leader(cfg, state), critic.save())
    saved_step = critic.trainer.step
    assert saved_step > 0
    assert uri.endswith("iter_2") or "iter_2" in uri
    assert session.store.list() == [2] and session.store.latest() == 2
    manifest = json.loads(session.store.s3.get_bytes(f"{uri.rsplit('/', 1)[1]}/state.json"))["state"]
    assert manifest["models"]["model.policy"] == policy and manifest["export"]["base"]["digest"] == policy["digest"]
    tokens, lengths = fixed_input(state.policy)
    with torch.no_grad():
        expected_logp = state.policy.logprobs(tokens, lengths)[0]
        expected_values, _ = critic.trainer.infer(tokens, lengths)
    saved = {"actor": clone(state.policy.model.state_dict()), "actor_optim": clone(state.optimizer.state_dict()),
             "critic": clone(critic.trainer.model.state_dict()),
             "critic_optim": clone(critic.trainer.optimizer.state_dict())}
    # the uninterrupted run goes on for one more iteration ...
    continued = run_iterations(cfg, session, state, critic, 1)[0]
    session.log_eval(3, {"eval/reward": 0.5}, [{"prompt": "p", "reward": 0.5}])  # ... and evaluates at its step 3
    critic.close()
    session.close("KILLED")

    # ... while a new process resumes from the store's latest checkpoint
    resumed = open_session(JOBS["rl"], cfg)
    assert resumed.resumed_from == 2
    assert resumed.tracker.run_id == session.tracker.run_id
    state2 = build_actor(cfg)
    assert restore_actor(resumed, Leader(cfg, state2)) is None  # same world size: nothing reset
    critic2 = LocalCritic(build_critic_trainer(cfg, checkpoint_dir=resumed.critic_dir))
    assert critic2.trainer.step == saved_step
    # what a checkpoint guarantees everywhere: the restored weights and optimizer states are bitwise the saved ones
    assert_bitwise(state2.policy.model.state_dict(), saved["actor"], "actor weights")
    assert_bitwise(state2.optimizer.state_dict(), saved["actor_optim"], "actor optimizer")
    assert_bitwise(critic2.trainer.model.state_dict(), saved["critic"], "critic weights")
    assert_bitwise(critic2.trainer.optimizer.state_dict(), saved["critic_optim"], "critic optimizer")
    # Outputs of identical weights on identical inputs may still differ by an ulp: the restored model's tensors live
    # in new allocations, and oneDNN/MKL pick GEMM kernels and blockings by buffer alignment and size (seen on CI: 6e-8
    # in 2 of 15 critic values). A float32 ulp at these magnitudes (|v| < 4) is <= 4.8e-7; 1e-6 absolute allows two.
    with torch.no_grad():
        torch.testing.assert_close(state2.policy.logprobs(tokens, lengths)[0], expected_logp, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(critic2.trainer.infer(tokens, lengths)[0], expected_values, rtol=1e-6, atol=1e-6)
    assert state2.iteration == 2 and state2.kl_ctl.value == pytest.approx(state.kl_ctl.value)
    again = run_iterations(cfg, resumed, state2, critic2, 1)[0]  # step 3 was logged by the first attempt: skipped
    keys = [k for k in continued if not k.startswith(NON_DETERMINISTIC)]
    assert {k: again[k] for k in keys} == pytest.approx({k: continued[k] for k in keys}, rel=1e-6, abs=1e-7)
    resumed.log_eval(3, {"eval/reward": 0.75}, [{"prompt": "p", "reward": 0.75}])  # recomputed: not logged again
    run_iterations(cfg, resumed, state2, critic2, 1)
    resumed.log_eval(4, {"eval/reward": 1.0}, [{"prompt": "p", "reward": 1.0}])
    critic2.close()
    resumed.close("FINISHED")
    client, run_id = resumed.tracker.client, resumed.tracker.run_id
    steps = [m.step for m in client.get_metric_history(run_id, "objective/kl")]
    assert steps == [1, 2, 3, 4]  # strictly increasing, no duplicate for the recomputed iteration 3
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward"))
    assert evals == [(3, 0.5), (4, 1.0)]  # the eval at 3 once, the first attempt's
    assert sorted(a.path for a in client.list_artifacts(run_id, "tables") if a.path.startswith("tables/eval_")) == [
        "tables/eval_000003.json", "tables/eval_000004.json"]


def test_shared_metric_names_in_mlflow(cfg):
    """A PPO run and an RLOO run log the same names for the same quantities."""
    names = {}
    for algorithm in ("ppo", "rloo"):
        c = prepare_run(cfg.model_copy(update={"algorithm": algorithm, "run_name": f"names-{algorithm}"}))
        session = open_session(JOBS["rl"], c)
        state = build_actor(c)
        if algorithm == "ppo":
            critic = LocalCritic(build_critic_trainer(c, checkpoint_dir=session.critic_dir))
            metrics, samples = train_step(state, load_prompts(c)[:8], c, Backends(critic=critic), gold_function(c))
            critic.close()
        else:
            from models.loop import build_local_reward

            metrics, samples = train_step(state, load_prompts(c)[:4], c, Backends(reward=build_local_reward(c)),
                                          gold_function(c))
        session.log_steps([(1, metrics)])
        session.close("FINISHED")
        run = session.tracker.client.get_run(session.tracker.run_id)
        names[algorithm] = set(run.data.metrics)
        assert run.data.tags["algorithm"] == algorithm
        assert run.data.params["loss.epsilon"] == "0.2"  # the recipe's value, as the run uses it
        artifacts = {a.path for a in session.tracker.client.list_artifacts(run.info.run_id)}
        assert "config.yaml" in artifacts
    for algorithm, logged in names.items():  # every name a run logs is in the list docs/metrics.md is generated from
        assert [name for name in logged if find(name, "rl") is None] == [], algorithm
    shared = names["ppo"] & names["rloo"]
    assert {"objective/kl", "reward", "objective/gold_reward", "objective/entropy", "policy/approxkl_avg",
            "loss", "step_time", "time/generate"} <= shared


def test_corrupted_checkpoint_is_refused(cfg):
    import boto3

    session = open_session(JOBS["rl"], cfg.model_copy(update={"run_name": "corrupt"}))
    checkpoint(session, Leader(cfg, build_actor(cfg)), None)
    session.close("FINISHED")
    endpoint, bucket = cfg.deploy.checkpoint.s3_endpoint_url, cfg.deploy.checkpoint.uri.split("/")[2]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/corrupt/iter_0-")["Contents"]
               if o["Key"].endswith("/actor/config.json"))
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps({"tampered": True}).encode())
    with pytest.raises(Exception, match="no checkpoint of .* passes its checks: file actor/config.json"):
        open_session(JOBS["rl"], cfg.model_copy(update={"run_name": "corrupt"}))
