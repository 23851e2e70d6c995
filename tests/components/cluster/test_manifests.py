"""The Kubernetes objects of a run (components/cluster/objects.py), as `rlhf cluster manifests` writes them and the
live path creates them: a 2-node x 2-GPU PPO run with 2 vLLM replicas validates against the real schemas (core kinds
with kubernetes-validate for Kubernetes 1.32 and 1.35, the JobSet and LeaderWorkerSet against the CRDs of the chart
versions infra/terraform installs), and each object says what the run needs: the node groups' torchrun and rank 0's
address from JobSet's own DNS, gang admission, restarts, ownership, the pods' volumes, secrets only by reference."""

from __future__ import annotations

import json

import pytest
import yaml

from components.cli.main import main as rlhf
from components.cluster.objects import (QUEUE_LABEL, RunIdentity, Site, jobset, leader_worker_set,
                                        server_args, server_urls)
from components.controller import node_spec
from components.launch.nodes import NodeSpec
from models.config import RLHFConfig, load_config
from tests.infra.schemas import validate

pytestmark = pytest.mark.fast

# a run's shape on the cluster placement (the command's own: the actor's node groups a JobSet, the servers
# LeaderWorkerSets; the images from the environment, as prefect.yaml gives every flow pod)
RUN = ["--set", "algorithm=ppo", "--set", "run_name=demo", "--set", "model.policy=org/policy",
       "--set", "model.reward=org/reward", "--set", "rollout.engine=vllm", "--set", "deploy.actor.nnodes=2",
       "--set", "deploy.actor.nproc_per_node=2", "--set", "deploy.actor.max_restarts=2",
       "--set", "deploy.rollout.replicas=2", "--set", "deploy.cluster.actor.gpus_per_node=2",
       "--set", "deploy.checkpoint.uri=s3://bucket/rlhf/checkpoints",
       "--set", "deploy.cluster.secret_env={PREFECT_API_KEY: prefect-api-key/key}"]
IMAGES = {"RLHF_IMAGE": "123.dkr.ecr.us-east-1.amazonaws.com/rlhf-flows:1",
          "RLHF_VLLM_IMAGE": "123.dkr.ecr.us-east-1.amazonaws.com/rlhf-flows-vllm:1",
          "MLFLOW_TRACKING_URI": "https://mlflow.example.com", "PREFECT_API_KEY": "pnu_not-to-be-copied"}


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    out = tmp_path_factory.mktemp("manifests")
    mp = pytest.MonkeyPatch()
    for k, v in IMAGES.items():
        mp.setenv(k, v)
    try:
        assert rlhf(["cluster", "manifests", *RUN, "--out", str(out)]) == 0
    finally:
        mp.undo()
    files = sorted(out.glob("*.yaml"))
    return {p.name: yaml.safe_load(p.read_text()) for p in files}


def _by_kind(manifests, kind):
    return [o for o in manifests.values() if o["kind"] == kind]


def test_a_two_node_ppo_run_with_two_vllm_replicas_writes_every_object_and_each_validates(manifests):
    kinds = sorted(o["kind"] for o in manifests.values())
    # the critic carries the reward model (critic.combine_reward): no reward server
    # the node groups' two policies (the controller's) and the servers' two (node group 0's Job's); the node pods'
    # Secret and the servers' two
    assert kinds == ["JobSet", "LeaderWorkerSet", "LeaderWorkerSet", *["NetworkPolicy"] * 4, *["Secret"] * 3]
    for obj in manifests.values():
        validate(obj)
        assert obj["metadata"]["namespace"] == "rlhf"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlhf-flows"


def test_the_jobset_runs_torchrun_on_every_node_and_finds_rank_0_through_its_own_dns(manifests):
    (js,) = _by_kind(manifests, "JobSet")
    name = js["metadata"]["name"]
    assert js["metadata"]["labels"][QUEUE_LABEL] == "rlhf"  # Kueue admits all its pods or none
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 2
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    (rjob,) = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["name"] == "node" and rjob["replicas"] == 1
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 2
    assert job["backoffLimit"] == 0  # the first failed pod fails the job: the JobSet restarts every group
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["python", "-m", "components.launch.nodes"]
    assert container["args"][3:9] == ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", "29500"]
    assert container["args"][9:] == ["--", "-m", "components.runs", "--store", "s3://bucket/rlhf/checkpoints/demo"]
    env = {e["name"]: e for e in container["env"]}
    # what the node command reads to find rank 0: <jobset>-node-0-0.<jobset>, from JobSet's annotations
    assert (env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.annotations['jobset.sigs.k8s.io/jobset-name']")
    assert "MASTER_ADDR" not in env and "hostname" not in json.dumps(js)
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"rlhf/role": "actor"} and pod["serviceAccountName"] == "rlhf-actor"
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "state": "/var/lib/rlhf", "cache": "/cache", "podinfo": "/etc/podinfo",
                      "run-secret": "/var/run/rlhf"}  # the run's secret, which the ranks prove to each other
    secret = next(v for v in pod["volumes"] if v["name"] == "run-secret")["secret"]["secretName"]
    assert secret.endswith("-nodes") and secret in {o["metadata"]["name"] for o in _by_kind(manifests, "Secret")}
    assert env["RLHF_RUN_SECRET_FILE"]["value"] == "/var/run/rlhf/secret"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"rendezvous": 29500, "ranks": 29501}
    assert env["RLHF_STATE_DIR"]["value"] == "/var/lib/rlhf" and env["HF_HOME"]["value"] == "/cache/huggingface"
    assert env["MLFLOW_TRACKING_URI"]["value"] == "https://mlflow.example.com"  # copied from the controller
    assert env["PREFECT_API_KEY"] == {"name": "PREFECT_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "prefect-api-key", "key": "key"}}}
    assert "pnu_not-to-be-copied" not in json.dumps(manifests)  # a secret is only ever referenced
    assert name.startswith("rlhf-demo-") and len(f"{name}-node-0-1") <= 63
    # the node groups reach each other through their own run's policy (no namespace-wide rule between pods)
    labels = job["template"]["metadata"]["labels"]
    ranks = next(p for p in _by_kind(manifests, "NetworkPolicy")
                 if p["metadata"]["name"] == f"rlhf-{labels['rlhf/run']}-run")
    assert ranks["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert {"podSelector": {"matchLabels": {"rlhf/run": labels["rlhf/run"]}}} in ranks["spec"]["egress"][0]["to"]
    assert pod["automountServiceAccountToken"] is True  # node group 0's rank 0 creates the run's servers


def test_each_server_is_a_leader_worker_set_of_its_replicas_holding_the_runs_secret_by_reference(manifests):
    lws = {o["metadata"]["labels"]["rlhf/part"]: o for o in _by_kind(manifests, "LeaderWorkerSet")}
    secrets = {o["metadata"]["name"]: o for o in _by_kind(manifests, "Secret")}
    assert lws["rollout"]["spec"]["replicas"] == 2 and lws["critic"]["spec"]["replicas"] == 1
    for kind, obj in lws.items():
        template = obj["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 1 and obj["metadata"]["labels"][QUEUE_LABEL] == "rlhf"
        (container,) = template["workerTemplate"]["spec"]["containers"]
        assert container["args"][:4] == ["python", "-m", "components.serving.pod", kind]
        assert container["image"] == IMAGES["RLHF_VLLM_IMAGE" if kind == "rollout" else "RLHF_IMAGE"]
        assert container["readinessProbe"]["httpGet"]["path"] == ("/health" if kind == "rollout"
                                                                  else "/v2/health/ready")
        volume = next(v for v in template["workerTemplate"]["spec"]["volumes"] if v["name"] == "run-secret")
        assert volume["secret"]["secretName"] in secrets
        assert {"name": "RLHF_RUN_SECRET_FILE", "value": "/var/run/rlhf/secret"} in container["env"]
        labels = template["workerTemplate"]["metadata"]["labels"]
        policies = _by_kind(manifests, "NetworkPolicy")
        servers = next(p for p in policies if p["metadata"]["name"] == f"rlhf-{labels['rlhf/run']}-run")
        assert servers["spec"]["podSelector"]["matchLabels"].items() <= labels.items()  # the run's policy selects it
        # a server's pods never call the API: no token; its Secret is named after the run's Job
        assert template["workerTemplate"]["spec"]["automountServiceAccountToken"] is False
        assert volume["secret"]["secretName"].startswith(f"{labels['rlhf/run']}-")
    for secret in secrets.values():  # a placeholder: the run's secret is made when the run starts
        assert secret["stringData"]["secret"].startswith("<")


def test_servers_are_found_at_the_leader_addresses_their_leader_worker_set_gives():
    """LWS_LEADER_ADDRESS is <lws>-<group>.<subdomain>.<namespace> (sigs.k8s.io/lws pkg/utils/pod), the subdomain the
    LeaderWorkerSet's own headless Service, named after it."""
    identity = RunIdentity.of("demo", "1")
    urls = server_urls(identity, "rollout", "rlhf", 2)
    lws = f"{identity.name}-rollout"
    assert urls == [f"http://{lws}-0.{lws}.rlhf:8000", f"http://{lws}-1.{lws}.rlhf:8000"]


def _cfg(**overrides) -> RLHFConfig:
    return load_config(None, {"model.policy": "org/policy", "model.reward": "org/reward", "rollout.engine": "vllm",
                              "deploy.cluster.image": "r/a:1", "deploy.cluster.vllm_image": "r/v:1", **overrides})


def test_the_config_a_server_pod_runs_with_is_the_runs_bound_to_the_pod():
    cfg = _cfg(**{"critic.optim.lr": 3e-6, "deploy.critic.port": 8400})
    args = server_args("critic", cfg, checkpoint_uri="s3://b/rlhf/checkpoints/demo", restore_iteration=4)
    sent = RLHFConfig.model_validate_json(args[args.index("--config-json") + 1])
    assert sent.critic.optim.lr == 3e-6 and sent.model.policy == "org/policy"
    assert (sent.deploy.critic.host, sent.deploy.critic.port, sent.deploy.state_dir) == ("0.0.0.0", 8000,
                                                                                         "/var/lib/rlhf")
    assert args[-4:] == ["--checkpoint-uri", "s3://b/rlhf/checkpoints/demo", "--restore-iteration", "4"]


def test_owned_by_the_runs_job_so_a_deleted_flow_run_pod_takes_them_with_it():
    cfg = _cfg()
    identity = RunIdentity("rlhf-demo-1", "ppo-x7k2q", {"name": "ppo-x7k2q", "uid": "uid-1"})
    site = Site.of(cfg.deploy.cluster, {})
    spec = node_spec(_cfg(**{"deploy.actor.nnodes": 2}), "demo", "s3://b/rlhf/checkpoints/demo")
    for obj in (jobset(spec, cfg.deploy.cluster, site, identity),
                leader_worker_set("critic", cfg, site, identity, ["x"])):
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "ppo-x7k2q",
                                                        "uid": "uid-1", "blockOwnerDeletion": False}]
        assert obj["metadata"]["labels"]["rlhf/run"] == "ppo-x7k2q"


def test_what_a_pod_cannot_have_is_refused_naming_the_field():
    site = Site.of(_cfg().deploy.cluster, {})
    identity = RunIdentity.of("demo", "1")
    with pytest.raises(ValueError,
                       match=r"deploy.rollout.tensor_parallel_size=2: .* 1 GPUs "
                             r"\(deploy.cluster.servers.gpus_per_node\)"):
        leader_worker_set("rollout", _cfg(**{"deploy.rollout.tensor_parallel_size": 2}), site, identity, ["x"])
    with pytest.raises(ValueError, match=r"deploy.actor.nproc_per_node=4.*deploy.cluster.actor.gpus_per_node=1"):
        jobset(NodeSpec("rlhf-demo", 2, 4, 29500, ["x"]), _cfg().deploy.cluster, site, identity)
    with pytest.raises(ValueError, match="DNS-1035"):
        jobset(NodeSpec("Demo_Run", 2, 1, 29500, ["x"]), _cfg().deploy.cluster, site, identity)
    with pytest.raises(ValueError, match=r"deploy.cluster.image.*RLHF_IMAGE"):
        Site.of(load_config(None, {"model.policy": "org/p"}).deploy.cluster, {})
    with pytest.raises(ValueError, match=r"secret_env"):
        _cfg(**{"deploy.cluster.env_from_controller": ["AWS_SECRET_ACCESS_KEY"]})
