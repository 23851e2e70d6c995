"""Static checks that runs sharing the cluster cannot harm each other (issues 32 and 4 of 4): the namespace enforces the
restricted Pod Security Standard and every pod the project puts there meets it (tests/infra/pod_security.py applies
the standard's controls); only the pods that create a run's objects hold a Kubernetes API token; the VPC CNI enforces
NetworkPolicies, the namespace denies traffic both ways by default and lets pods out only to DNS, the API (the pods
that call it) and addresses outside the VPC but the instance metadata service, never to other pods; a run's pods
carry the labels its own policies select on (components/cluster/network_policy.py, cross-checked here); a run may
create and delete its objects and read its Job, nothing more (the admission policy that keeps it to its own objects:
test_admission_policy.py). (A run's S3 credentials: test_run_credentials.py; checkov scans the new resources in
test_terraform.)"""

from __future__ import annotations

import copy

import pytest

from tests.infra.pod_security import violations
from tests.infra.test_terraform import (ENV_DEV, MODULES, _blocks, _locals, _one, _render_template, _resources,
                                        _sample_values)

from components.cluster.network_policy import JOB_LABEL, PODINFO_DIR, RUN_LABEL, own_job, policies
from components.cluster.objects import RunIdentity, Site, run_manifests
from components.controller import node_spec
from models.config import load_config, merge

pytestmark = pytest.mark.fast

# prefect-helm's prefect-worker chart at the version modules/addons pins (values.yaml): what the worker's pod and
# containers get unless the release's values say otherwise (Helm merges those over these)
WORKER_CHART_DEFAULTS = {
    "podSecurityContext": {"runAsUser": 1001, "runAsNonRoot": True, "fsGroup": 1001,
                           "seccompProfile": {"type": "RuntimeDefault"}},
    "containerSecurityContext": {"runAsUser": 1001, "runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                 "allowPrivilegeEscalation": False, "capabilities": {}},
}


def _spec(body: dict) -> dict:
    return body["spec"][0] if isinstance(body["spec"], list) else body["spec"]


def _merged(base: dict, over: dict) -> dict:
    """Helm's merge of a release's values over a chart's: maps merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _run_pods() -> dict[str, dict]:
    """The pods of a run's own objects (`rlhf cluster manifests`' builders): its node groups' and every server's."""
    cfg = load_config(None, {
        "algorithm": "ppo", "model.policy": "org/policy", "model.reward": "org/reward", "rollout.engine": "vllm",
        "critic.combine_reward": False, "deploy.actor.nnodes": 2, "deploy.actor.launch": "jobset",
        "deploy.rollout.launch": "kubernetes", "deploy.critic.launch": "kubernetes",
        "deploy.reward.launch": "kubernetes", "deploy.cluster.image": "r.example.com/rlhf-flows:1",
        "deploy.cluster.vllm_image": "r.example.com/rlhf-flows-vllm:1"}, preset="none")
    site = Site.of(cfg.deploy.cluster, {})
    objects = run_manifests(cfg, site, RunIdentity.of("demo", "1"), node_spec(cfg, "demo", "s3://b/demo"))
    pods = {}
    for obj in objects:
        if obj["kind"] == "JobSet":
            pods["JobSet node pod"] = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            part = obj["metadata"]["labels"]["rlhf/part"]
            pods[f"{part} server pod"] = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert set(pods) == {"JobSet node pod", "rollout server pod", "critic server pod", "reward server pod"}
    return pods


def _worker_pod() -> dict:
    """The Prefect worker's pod as the chart's Deployment renders it from modules/addons' values."""
    release = _resources(MODULES / "addons")[("helm_release", "prefect_worker")]["values"][0]
    ours = _locals(MODULES / "addons")
    given = {key: ours[local] for key, local in (("podSecurityContext", "worker_pod_security"),
                                                 ("containerSecurityContext", "worker_container_security"))
             if f"{key} = local.{local}" in release}  # what the release passes to the chart
    values = _merged(WORKER_CHART_DEFAULTS, given)
    return {"metadata": {"labels": {"app.kubernetes.io/name": "prefect-worker"}},
            "spec": {"serviceAccountName": "prefect-worker", "securityContext": values["podSecurityContext"],
                     "containers": [{"name": "prefect-worker", "image": "prefecthq/prefect:3.8.8-python3.11-kubernetes",
                                     "securityContext": values["containerSecurityContext"],
                                     "volumeMounts": [{"name": "scratch", "mountPath": "/home/prefect"}]}],
                     "volumes": [{"name": "scratch", "emptyDir": {}}]}}


def test_the_vpc_cni_enforces_network_policies():
    addon = _resources(MODULES / "cluster")[("aws_eks_addon", "vpc_cni")]
    assert addon["addon_name"] == "vpc-cni" and "enableNetworkPolicy" in addon["configuration_values"]
    assert '"true"' in addon["configuration_values"]
    assert "vpc_cni_version" in _blocks(MODULES / "cluster", "variable")


def test_the_namespace_enforces_the_restricted_pod_security_standard():
    labels = _one(_resources(ENV_DEV)[("kubernetes_namespace_v1", "rlhf")]["metadata"])["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", mode
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "v${var.kubernetes_version}", mode


def test_every_pod_in_the_namespace_meets_the_restricted_profile(rendered):
    """The pods of a run's JobSet and LeaderWorkerSets, every deployment's flow-run pod (as Prefect's worker renders
    it), the Prefect workers' pods: Pod Security Admission would admit each."""
    pods = {**_run_pods(), "Prefect worker pod": _worker_pod(),
            **{f"{name} flow-run pod": job["spec"]["template"] for name, (_, job) in rendered.items()}}
    assert len(pods) == 5 + len(rendered)
    found = {name: problems for name, pod in pods.items() if (problems := violations(pod))}
    assert not found, found


def test_the_restricted_check_refuses_what_the_standard_forbids():
    pod = _run_pods()["critic server pod"]
    assert violations(pod) == []

    def container(p):
        return p["spec"]["containers"][0]

    cases = [
        (lambda p: p["spec"].update(hostNetwork=True), "host namespaces"),
        (lambda p: container(p)["securityContext"].update(privileged=True), "privileged"),
        (lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath volumes"),
        (lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}), "volume types"),
        (lambda p: container(p)["securityContext"].pop("allowPrivilegeEscalation"), "privilege escalation"),
        (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "running as non-root"),
        (lambda p: container(p)["securityContext"].update(runAsUser=0), "non-root user"),
        (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccomp"),
        (lambda p: container(p)["securityContext"].update(capabilities={"add": ["SYS_ADMIN"], "drop": ["ALL"]}),
         "capabilities"),
        (lambda p: container(p)["ports"].append({"containerPort": 80, "hostPort": 80}), "host ports"),
        (lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctls"),
        (lambda p: container(p)["readinessProbe"]["httpGet"].update(host="169.254.169.254"), "probe or lifecycle host"),
    ]
    for change, control in cases:
        broken = copy.deepcopy(pod)
        change(broken)
        assert any(v.startswith(control) or control in v for v in violations(broken)), (control, violations(broken))
    # the chart's own container defaults drop no capability: why modules/addons sets them
    worker = _worker_pod()
    worker["spec"]["containers"][0]["securityContext"] = WORKER_CHART_DEFAULTS["containerSecurityContext"]
    assert violations(worker) == ["capabilities: container prefect-worker does not drop ALL"]


def test_only_the_pods_that_create_a_runs_objects_hold_an_api_token(rendered):
    """The actor's account mounts a token (a run's controller and node group 0 create its objects); the critic's
    does not by default (servers and the flows that need no GPU never call the API), and a server's pods opt out
    themselves: the admission policy refuses a LeaderWorkerSet whose pods do not."""
    account = _resources(ENV_DEV)[("kubernetes_service_account_v1", "pod")]
    assert account["automount_service_account_token"] == "${each.key == var.actor_service_account_name}"
    pods = _run_pods()
    assert pods["JobSet node pod"]["spec"]["automountServiceAccountToken"] is True
    for kind in ("rollout", "critic", "reward"):
        assert pods[f"{kind} server pod"]["spec"]["automountServiceAccountToken"] is False, kind
    for name, (_, job) in rendered.items():  # the work pools leave it to the account
        assert "automountServiceAccountToken" not in job["spec"]["template"]["spec"], name


def test_the_namespace_denies_both_ways_and_lets_pods_out_only_to_dns_the_api_and_outside_the_vpc():
    resources = _resources(ENV_DEV)
    deny = _spec(resources[("kubernetes_network_policy_v1", "default_deny")])
    assert sorted(deny["policy_types"]) == ["Egress", "Ingress"] and "ingress" not in deny and "egress" not in deny
    assert deny["pod_selector"] in ([{}], {}, [])  # every pod of the namespace
    # no namespace-wide rule between pods: a run's ranks reach each other through the run's own policies
    policies_here = {name for kind, name in resources if kind == "kubernetes_network_policy_v1"}
    assert policies_here == {"default_deny", "egress_dns", "egress_outside", "egress_kubernetes_api", "egress_in_vpc"}
    for name in policies_here - {"default_deny"}:
        spec = _spec(resources[("kubernetes_network_policy_v1", name)])
        assert spec["policy_types"] == ["Egress"] and "ingress" not in spec, name
    dns = _one(_spec(resources[("kubernetes_network_policy_v1", "egress_dns")])["egress"])
    peer = _one(dns["to"])
    assert _one(peer["namespace_selector"])["match_labels"] == {"kubernetes.io/metadata.name": "kube-system"}
    assert _one(peer["pod_selector"])["match_labels"] == {"k8s-app": "kube-dns"}
    assert sorted((p["protocol"], p["port"]) for p in dns["ports"]) == [("TCP", "53"), ("UDP", "53")]
    outside = _one(_one(_one(_spec(resources[("kubernetes_network_policy_v1", "egress_outside")])["egress"])["to"])[
        "ip_block"])
    assert outside["cidr"] == "0.0.0.0/0"
    # no pod of the VPC (other runs'), no ClusterIP, no link-local address (the instance metadata service)
    assert set(outside["except"]) == {"${var.vpc_cidr}", "${module.cluster.service_cidr}", "169.254.0.0/16"}
    api = resources[("kubernetes_network_policy_v1", "egress_kubernetes_api")]
    assert '{"rlhf/role" = "actor"}' in api["for_each"] and '{"app.kubernetes.io/name" = "prefect-worker"}' in api[
        "for_each"]  # the pods that call the API; never the servers
    rule = _one(_spec(api)["egress"])
    assert rule["ports"] == [{"protocol": "TCP", "port": "443"}]
    assert "cidrhost(module.cluster.service_cidr, 1)" in rule["dynamic"][0]["to"]["for_each"]
    assert "service_cidr" in _blocks(MODULES / "cluster", "output")


def test_only_a_runs_own_pods_carry_its_label_and_every_pod_reads_its_job_from_its_labels(tmp_path):
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
    run, job_pods = policies(job, "rlhf", "uid")
    # the run labels the pods of the objects it creates (its Job's name); Kubernetes labels its own Job's pods
    cfg = load_config(None, {"deploy.cluster.image": "r.example.com/rlhf-flows:1"}, preset="none")
    objects = run_manifests(merge(cfg, {"deploy.critic.launch": "kubernetes"}), Site.of(cfg.deploy.cluster, {}),
                            RunIdentity.of("demo", "1", run_label=job))
    server = next(o for o in objects if o["kind"] == "LeaderWorkerSet")
    assert server["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"][RUN_LABEL] == job
    assert run["spec"]["podSelector"]["matchLabels"] == {RUN_LABEL: job}
    assert job_pods["spec"]["podSelector"]["matchLabels"] == {JOB_LABEL: job}


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
