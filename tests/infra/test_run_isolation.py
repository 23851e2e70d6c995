"""Static checks that a run's servers on the cluster serve that run only (issue 32): the VPC CNI enforces
NetworkPolicies; the namespace denies ingress by default and lets actor pods reach actor pods; a run's server pods
carry the rlhf/run label the run's own policies select on, and no flow run's pod can give itself one
(components/cluster/network_policy.py, cross-checked here); a run
may create and delete NetworkPolicies and read its Job, nothing more; the critic role writes only its pending saves;
leases and commit points are written only by conditional puts. (checkov scans the new resources in test_terraform.)"""

from __future__ import annotations

from tests.infra.test_terraform import (ENV_DEV, MODULES, _blocks, _locals, _one, _render_template, _resources,
                                        _sample_values)

from components.cluster.network_policy import JOB_LABEL, PODINFO_DIR, RUN_LABEL, own_job, policies
from components.cluster.objects import RunIdentity, Site, leader_worker_set
from models.config import load_config


def _spec(body: dict) -> dict:
    return body["spec"][0] if isinstance(body["spec"], list) else body["spec"]


def test_the_vpc_cni_enforces_network_policies():
    addon = _resources(MODULES / "cluster")[("aws_eks_addon", "vpc_cni")]
    assert addon["addon_name"] == "vpc-cni" and "enableNetworkPolicy" in addon["configuration_values"]
    assert '"true"' in addon["configuration_values"]
    assert "vpc_cni_version" in _blocks(MODULES / "cluster", "variable")


def test_the_namespace_denies_ingress_but_between_actor_ranks():
    resources = _resources(ENV_DEV)
    deny = _spec(resources[("kubernetes_network_policy_v1", "default_deny_ingress")])
    assert deny["policy_types"] == ["Ingress"] and "ingress" not in deny
    assert deny["pod_selector"] in ([{}], {}, [])  # every pod of the namespace
    ranks = _spec(resources[("kubernetes_network_policy_v1", "actor_ranks")])
    assert _one(ranks["pod_selector"])["match_labels"] == {"rlhf/role": "actor"}
    source = _one(_one(_one(ranks["ingress"])["from"])["pod_selector"])
    assert source["match_labels"] == {"rlhf/role": "actor"}  # never a server, never another namespace


def test_only_a_runs_own_server_pods_carry_its_label_and_every_pod_reads_its_job_from_its_labels(tmp_path):
    for pool, role in (("actor-gpu", "actor"), ("critic-gpu", "critic")):
        template = _render_template(_sample_values(pool, role))
        pod = template["job_configuration"]["job_manifest"]["spec"]["template"]
        # a flow run's pod never carries a run's rlhf/run label: no job variable sets a label
        assert pod["metadata"]["labels"] == {"rlhf/role": role}
        assert not {"labels", "run_label"} & set(template["variables"]["properties"])
        # the pod's own labels, where own_job reads the Job it runs in (the downward API)
        podinfo = next(v for v in pod["spec"]["volumes"] if v["name"] == "podinfo")
        assert podinfo["downwardAPI"]["items"] == [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
        mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "podinfo")
        assert mount == {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True}
    (tmp_path / "labels").write_text('batch.kubernetes.io/job-name="ppo-x7k2q"\nrlhf/role="actor"')
    job = own_job({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path / "labels"))
    servers, trainer = policies(job, "rlhf", "uid")
    # the run labels its servers' pods (their LeaderWorkerSet's template: its Job's name); Kubernetes labels its own
    # Job's pods
    cfg = load_config(None, "tiny")
    site = Site.of(cfg.deploy.cluster, {"RLHF_IMAGE": "registry.example.com/rlhf-flows:1"})
    lws = leader_worker_set("critic", cfg, site, RunIdentity.of("demo", "1", run_label=job), ["python"])
    assert lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"][RUN_LABEL] == job
    assert servers["spec"]["podSelector"]["matchLabels"] == {RUN_LABEL: job}
    assert trainer["spec"]["podSelector"]["matchLabels"] == {JOB_LABEL: job}


def test_a_run_may_manage_its_own_objects_in_its_namespace_only():
    """Least privilege: the objects a run creates (components/cluster: JobSet, LeaderWorkerSets, their Secrets, its
    NetworkPolicies), reads of its Job, of pods and their logs, and of Kueue's workloads; no update, no patch, no
    watch, nothing cluster-wide, no reading of Secrets."""
    resources = _resources(ENV_DEV)
    role = resources[("kubernetes_role_v1", "run")]
    rules = {(tuple(r["api_groups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rule"]}
    assert rules == {(("jobset.x-k8s.io",), ("jobsets",)): {"create", "get", "delete"},
                     (("leaderworkerset.x-k8s.io",), ("leaderworkersets",)): {"create", "get", "delete"},
                     (("",), ("secrets",)): {"create", "delete"},
                     (("",), ("pods", "pods/log")): {"get", "list"},
                     (("networking.k8s.io",), ("networkpolicies",)): {"create", "delete"},
                     (("batch",), ("jobs",)): {"get"},
                     (("kueue.x-k8s.io",), ("workloads",)): {"list"}}
    binding = resources[("kubernetes_role_binding_v1", "run")]
    subject = _one(binding["subject"])
    assert subject["kind"] == "ServiceAccount" and subject["name"] == "${var.actor_service_account_name}"
    assert _one(binding["role_ref"])["kind"] == "Role"  # namespaced, never a ClusterRole


def test_the_critic_writes_only_its_pending_saves_and_leases_and_commits_are_conditional():
    module = MODULES / "iam"
    writes = _locals(module)["write_resources"]
    assert writes["critic"] == ["${var.bucket_arn}/${var.checkpoint_prefix}*/critic-pending/*"]
    assert writes["actor"] == ["${var.bucket_arn}/${var.s3_prefix}*"]
    document = _resources(module, "data")[("aws_iam_policy_document", "s3")]
    statements = {s.get("sid"): s for s in document["statement"]}
    assert statements["ObjectsUnderPrefix"]["actions"] == "${local.read_actions}"  # reads everywhere, writes per role
    lease = statements["LeasesOnlyByConditionalWrites"]
    assert lease["effect"] == "Deny" and lease["resources"] == ["${var.bucket_arn}/${var.checkpoint_prefix}*/lease.json"]
    assert {(c["test"], c["variable"]) for c in lease["condition"]} == {("Null", "s3:if-none-match"),
                                                                        ("Null", "s3:if-match")}
    commit = statements["CommitPointsCreateOnly"]
    assert commit["effect"] == "Deny" and commit["resources"][0].endswith("*/state.json")
    assert [(c["test"], c["variable"]) for c in commit["condition"]] == [("Null", "s3:if-none-match")]
    assert _blocks(ENV_DEV, "module")["iam"]["checkpoint_prefix"] == "${var.checkpoint_prefix}"
