"""The critic part of a checkpoint in launch=kubernetes: a critic server in a pod of its own that uploads its saves to
the run's store (S3 on a moto server), a checkpoint that adopts the save of its own iteration, a resume that starts the
server from it, and restore errors that fail the run naming the URI and the cause (an S3 endpoint answering 403,
through a proxy). The pod itself is not run here (no cluster): its server is started with what the pod gives it
(components/serving/pod.py: its own directory, the run's store, the iteration to restore)."""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import pytest

from components.launch.processes import find_free_ports
from components.launch.processes import ServerNotReady
from components.serving.launcher import launch
from components.serving.triton.clients import critic_backend
from components.serving.triton.contract import PENDING_PREFIX, ServerSpec
from components.storage.backends import CheckpointError
from components.jobs.rl import checkpoint
from components.runs import JOBS, open_session
from models.config import merge, preset
from models.algorithms import Backends
from models.loop import Leader, build_actor, gold_function, load_prompts, prompt_batches
from models.prepare import prepare_run
from models.step import train_step
from tests.s3_proxy import s3_proxy

pytestmark = pytest.mark.slow(2)


@pytest.fixture
def cfg(tiny_models, tmp_path, s3_bucket, mlflow_uri):
    endpoint, bucket = s3_bucket
    return prepare_run(preset("tiny", **{
        "deploy.state_dir": str(tmp_path / "state"), "model.policy": tiny_models["policy"],
        "model.reward": tiny_models["reward"], "run_name": "dep-critic", "algorithm": "ppo",
        "deploy.critic.launch": "kubernetes", "deploy.checkpoint.uri": f"s3://{bucket}/ckpt",
        "deploy.checkpoint.s3_endpoint_url": endpoint, "deploy.tracking.uri": mlflow_uri,
        "deploy.tracking.system_metrics": False, "ppo.rollout_batch_size": 8, "ppo.minibatch_size": 8,
        "ppo.epochs": 1, "generation.max_new_tokens": 6, "critic.train_batch_size": 8}))


def critic_server(cfg, session, directory, restore_iteration=None):
    """What a critic server pod runs (components/serving/pod.py): a server with its own directory that uploads its
    saves to the run's store."""
    spec = ServerSpec(kind="critic", config=cfg, port=find_free_ports(), checkpoint_dir=str(directory),
                      checkpoint_uri=session.store.uri, restore_iteration=restore_iteration, torch_threads=1)
    return launch(spec, directory.parent / f"{directory.name}.log")


def iterate(cfg, session, state, critic, n):
    batches = prompt_batches(load_prompts(cfg), cfg.ppo.rollout_batch_size, cfg.seed, start_batch=state.iteration)
    for _ in range(n):
        metrics, samples = train_step(state, next(batches), cfg, Backends(critic=critic), gold_function(cfg))
        session.log_steps([(state.iteration, metrics)])


def test_a_crash_between_critic_save_and_actor_checkpoint_resumes_both_of_one_iteration(cfg, tmp_path):
    session = open_session(JOBS["rl"], cfg)
    state = build_actor(cfg)
    with critic_server(cfg, session, tmp_path / "node-a") as server:
        client = critic_backend(cfg, server.url)
        try:
            iterate(cfg, session, state, client, 1)
            checkpoint(session, Leader(cfg, state), client.save())
            iterate(cfg, session, state, client, 1)
            # the critic of iteration 2 reaches the store, then the flow dies before its checkpoint
            newer = client.save()
        finally:
            client.close()
    session.close("KILLED")
    store = session.store
    assert store.latest() == 1
    key = store.path_of(1)  # iter_1's own prefix
    files = store._backend.list_keys(f"{key}/critic")
    assert f"{key}/critic/critic_state.pt" in files and f"{key}/critic/model/model.safetensors" in files
    assert store.key_of(newer["path"]) == f"{PENDING_PREFIX}/step-{newer['step']}"  # never adopted

    resumed = open_session(JOBS["rl"], cfg)
    assert resumed.resumed_from == 1 and resumed.critic_restore_iteration == 1
    assert not (resumed.local_dir / "restore" / "critic").exists()  # the server restores its part itself
    saved_step = resumed.manifest["critic_step"]
    assert 0 < saved_step < newer["step"]
    with critic_server(cfg, resumed, tmp_path / "node-b", restore_iteration=resumed.critic_restore_iteration) as server:
        client = critic_backend(cfg, server.url)
        try:
            assert client.save()["step"] == saved_step  # the critic of the actor's iteration, not the newer one
        finally:
            client.close()
    resumed.close("FINISHED")


@pytest.fixture
def forbidding_endpoint(s3_bucket):
    """An S3 endpoint (a proxy in front of moto) that answers 403 to reads of any iter_1[-<id>]/critic/ object."""
    with s3_proxy(s3_bucket[0], forbidden=r"/iter_1(-[^/]+)?/critic/") as endpoint:
        yield endpoint


def test_a_403_on_the_critic_checkpoint_fails_the_run_naming_the_uri(cfg, forbidding_endpoint, tmp_path):
    local = merge(cfg, {"deploy.critic.launch": "in_process"})
    session = open_session(JOBS["rl"], local)
    state = build_actor(local)
    from models.backends import LocalCritic
    from models.loop import build_critic_trainer

    critic = LocalCritic(build_critic_trainer(local, checkpoint_dir=session.critic_dir))
    iterate(local, session, state, critic, 1)
    checkpoint(session, Leader(local, state), critic.save())
    critic.close()
    session.close("KILLED")
    bucket = urlparse(cfg.deploy.checkpoint.uri).netloc
    critic_uri = re.compile(rf"s3://{bucket}/ckpt/dep-critic/iter_1-[^/]+/critic/")

    # the run (critic local or in process) downloads the critic part itself: a 403 fails it (never a fallback to an
    # older checkpoint: only a checkpoint that fails its checks is passed over)
    forbidden = merge(local, {"deploy.checkpoint.s3_endpoint_url": forbidding_endpoint})
    with pytest.raises(CheckpointError) as err:
        open_session(JOBS["rl"], forbidden)
    assert critic_uri.search(str(err.value)) and "403" in str(err.value) and "passes its checks" not in str(err.value)

    # launch=kubernetes: the run reads only the actor; the critic server's restore fails, naming the URI and the 403
    pod = merge(forbidden, {"deploy.critic.launch": "kubernetes"})
    resumed = open_session(JOBS["rl"], pod)
    assert resumed.critic_restore_iteration == 1
    with pytest.raises(ServerNotReady) as err:
        critic_server(pod, resumed, tmp_path / "node-c", restore_iteration=1)
    assert err.value.reason == "not_ready"
    assert critic_uri.search(str(err.value)) and "403" in str(err.value)
    resumed.close("FAILED")
    assert json.loads(json.dumps(resumed.manifest["critic_step"])) > 0
