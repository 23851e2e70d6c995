"""The runs' admission policy (infra/terraform/modules/admission): rendered as Terraform's templatefile renders it,
validated as a Kubernetes object, and evaluated as the API server evaluates it (tests/infra/admission.py, on celpy) on
the objects components/cluster builds for a run: its JobSet (the builder JobSetNodes uses), its servers' Secrets and
LeaderWorkerSets (start_servers'), its NetworkPolicies (RunPolicies'). A run's own objects, asked for by a pod of its
own Job, are admitted; a privileged pod, a hostPath, another service account, another run's Secret, another run's
Job, and the deletion of what its Job does not own are refused, each naming the rule.

The requester is the pod the token is bound to (userInfo.extra authentication.kubernetes.io/pod-name): a flow run's
Job brave-heron-x7k2q runs pod brave-heron-x7k2q-bcdfg; its node groups' Job <jobset>-node-0 runs node group 0 as
<jobset>-node-0-0-<5 random> (Kubernetes' names: <job>-<5 random>, an Indexed Job's <job>-<index>-<5 random>)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from components.cluster.network_policy import policies
from components.cluster.objects import RunIdentity, Site, jobset, server_objects
from components.controller import node_spec
from models.config import load_config
from tests.infra.admission import AdmissionPolicy, Request
from tests.infra.schemas import validate
from tests.infra.test_terraform import ENV_DEV, MODULES, _blocks, _locals, _render_template

pytestmark = pytest.mark.fast

TEMPLATE = MODULES / "admission" / "templates" / "run_admission.yaml.tftpl"
REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
VALUES = {"name": "rlhf-run", "namespace": "rlhf", "actor_service_account": "rlhf-actor",
          "server_service_account": "rlhf-critic", "image_repositories": [f"{REGISTRY}/rlhf-flows",
                                                                         f"{REGISTRY}/rlhf-flows-vllm"],
          "cache_claim": "rlhf-cache", "shared_secrets": ["prefect-api-key"]}
ACTOR = "system:serviceaccount:rlhf:rlhf-actor"

CONTROLLER = "brave-heron-x7k2q"  # a flow run's Job: the run's controller
CONTROLLER_POD = f"{CONTROLLER}-bcdfg"
OTHER = "calm-otter-p4q9z"  # another run's flow-run Job
OTHER_POD = f"{OTHER}-lmnpq"


def _rendered() -> list[dict]:
    return _render_template(VALUES, TEMPLATE, yaml.safe_load)


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    return AdmissionPolicy(*_rendered())


def _cfg():
    return load_config(None, {
        "algorithm": "ppo", "model.policy": "org/policy", "model.reward": "org/reward", "rollout.engine": "vllm",
        "critic.combine_reward": False, "deploy.actor.nnodes": 2, "deploy.actor.nproc_per_node": 1,
        "deploy.actor.launch": "jobset", "deploy.rollout.launch": "kubernetes", "deploy.critic.launch": "kubernetes",
        "deploy.reward.launch": "kubernetes", "deploy.cluster.image": f"{REGISTRY}/rlhf-flows:1.4.0",
        "deploy.cluster.vllm_image": f"{REGISTRY}/rlhf-flows-vllm:1.4.0",
        "deploy.cluster.secret_env": {"PREFECT_API_KEY": "prefect-api-key/key"}}, preset="none")


class Run:
    """A run's objects as the live path builds them: the controller's JobSet and its policies, and node group 0's
    servers (rollout, critic, reward) and their policies, each owned by the Job whose pod creates it."""

    def __init__(self, controller: str = CONTROLLER):
        cfg = self.cfg = _cfg()
        site = Site.of(cfg.deploy.cluster, {})
        spec = node_spec(cfg, f"demo-{controller}", "s3://bucket/rlhf/checkpoints/demo")
        self.controller, self.controller_pod = controller, f"{controller}-bcdfg"
        owner = RunIdentity.of("demo", "1", run_label=controller, owner={"name": controller, "uid": "uid-controller"})
        self.jobset = jobset(spec, cfg.deploy.cluster, site, owner)
        self.controller_policies = policies(controller, "rlhf", "uid-controller")
        self.nodes = f"{spec.name}-node-0"  # the node groups' Job: node group 0's rank 0 runs the run
        self.node_pod = f"{self.nodes}-0-xz2q4"
        servers = RunIdentity.of("demo", "a1b2c3d4", run_label=self.nodes,
                                 owner={"name": self.nodes, "uid": "uid-nodes"})
        self.servers = {kind: server_objects(kind, cfg, site, servers, secret_value="s3cret",
                                             **({"trainer_host": "10.0.0.7"} if kind == "rollout" else {}))
                        for kind in ("rollout", "critic", "reward")}
        self.server_policies = policies(self.nodes, "rlhf", "uid-nodes")

    def secret(self, kind="critic") -> dict:
        return copy.deepcopy(self.servers[kind][0])

    def lws(self, kind="critic") -> dict:
        return copy.deepcopy(self.servers[kind][1])

    def js(self) -> dict:
        return copy.deepcopy(self.jobset)


@pytest.fixture(scope="module")
def run() -> Run:
    return Run()


def _created_by(obj: dict, pod: str) -> Request:
    return Request("CREATE", obj, pod=pod)


def _pod_spec(obj: dict) -> dict:
    if obj["kind"] == "JobSet":
        return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]


def _refused(policy, request, rule: str) -> None:
    decision = policy.admit(request)
    assert decision.applied and not decision.allowed, f"admitted: {request.subject['kind']}"
    assert any(re.search(rule, m) for m in decision.messages), decision.messages


# ------------------------------------------------------------------------------------------------ the objects
def test_the_policy_and_its_binding_are_valid_kubernetes_objects_bound_to_the_runs_namespace():
    vap, binding = _rendered()
    for obj in (vap, binding):
        validate(obj)  # admissionregistration.k8s.io/v1, Kubernetes 1.32 and 1.35 (strict)
    assert vap["spec"]["failurePolicy"] == "Fail"  # an expression that errs refuses, never admits
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "rlhf"}}
    resources = {r for rule in vap["spec"]["matchConstraints"]["resourceRules"] for r in rule["resources"]}
    assert resources == {"jobsets", "leaderworkersets", "secrets", "networkpolicies"}  # what the run's Role creates
    assert all(set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
               for rule in vap["spec"]["matchConstraints"]["resourceRules"])


def test_terraform_installs_it_for_the_runs_namespace_accounts_images_cache_and_shared_secrets():
    call = _blocks(ENV_DEV, "module")["admission"]
    assert call["source"] == "../../modules/admission" and "manage_kubernetes_resources" in call["count"]
    assert call["namespace"] == "${kubernetes_namespace_v1.rlhf[0].metadata[0].name}"
    assert call["actor_service_account_name"] == "${var.actor_service_account_name}"
    assert call["server_service_account_name"] == "${var.critic_service_account_name}"
    assert "module.registry.repository_urls" in call["image_repositories"]  # the project's own ECR repositories
    assert call["cache_claim"] == "${var.cache_claim_name}"
    assert "kubernetes_secret_v1.prefect_api_key" in call["shared_secrets"]
    template_call = _locals(MODULES / "admission")["objects"]
    passed = set(re.findall(r"(\w+)\s*=", re.search(r"templatefile\([^{]*\{(.*)\}\)", template_call, re.S).group(1)))
    assert passed == set(VALUES) == set(re.findall(r"\$\{jsonencode\((\w+)\)\}", TEMPLATE.read_text()))


# ------------------------------------------------------------------------------------------------ admitted
def test_a_runs_own_jobset_is_admitted_from_its_controllers_pod(policy, run):
    validate(run.jobset)
    decision = policy.admit(_created_by(run.js(), run.controller_pod))
    assert decision.applied and decision.allowed, decision
    for network_policy in run.controller_policies:  # the node groups' rendezvous, both ways
        decision = policy.admit(_created_by(network_policy, run.controller_pod))
        assert decision.applied and decision.allowed, decision


def test_a_runs_own_servers_and_their_policies_are_admitted_from_node_group_0(policy, run):
    for kind, (secret, lws) in run.servers.items():
        validate(secret)
        validate(lws)
        for obj in (secret, lws):
            decision = policy.admit(_created_by(obj, run.node_pod))
            assert decision.applied and decision.allowed, (kind, obj["kind"], str(decision))
    for network_policy in run.server_policies:
        decision = policy.admit(_created_by(network_policy, run.node_pod))
        assert decision.applied and decision.allowed, decision


def test_a_single_node_runs_servers_are_admitted_from_its_flow_run_pod(policy, run):
    """Without node groups the flow run's pod runs the run and creates its servers, owned by its own Job."""
    site = Site.of(run.cfg.deploy.cluster, {})
    identity = RunIdentity.of("demo", "e5f6a7b8", run_label=CONTROLLER, owner={"name": CONTROLLER, "uid": "uid-c"})
    for obj in server_objects("critic", run.cfg, site, identity, secret_value="s") + policies(CONTROLLER, "rlhf", "u"):
        decision = policy.admit(_created_by(obj, CONTROLLER_POD))
        assert decision.applied and decision.allowed, (obj["kind"], str(decision))


def test_a_run_deletes_what_its_job_owns(policy, run):
    for obj, pod in [(run.jobset, run.controller_pod), *((o, run.node_pod) for o in run.servers["critic"]),
                     *((o, run.node_pod) for o in run.server_policies)]:
        decision = policy.admit(Request("DELETE", None, old_object=obj, pod=pod))
        assert decision.applied and decision.allowed, (obj["kind"], str(decision))


# ------------------------------------------------------------------------------------------------ refused: the pods
def test_a_jobset_with_a_privileged_pod_is_refused(policy, run):
    obj = run.js()
    _pod_spec(obj)["containers"][0]["securityContext"]["privileged"] = True
    _refused(policy, _created_by(obj, run.controller_pod), "not privileged")
    obj = run.js()  # in an init container too
    _pod_spec(obj)["initContainers"] = [{**copy.deepcopy(_pod_spec(obj)["containers"][0]), "name": "init",
                                         "securityContext": {"privileged": True, "allowPrivilegeEscalation": True}}]
    _refused(policy, _created_by(obj, run.controller_pod), "not privileged")


def test_a_hostpath_volume_is_refused(policy, run):
    for obj, pod in ((run.js(), run.controller_pod), (run.lws(), run.node_pod)):
        spec = _pod_spec(obj)
        spec["volumes"].append({"name": "node", "hostPath": {"path": "/var/lib/kubelet"}})
        spec["containers"][0]["volumeMounts"].append({"name": "node", "mountPath": "/node"})
        _refused(policy, _created_by(obj, pod), "no hostPath")


def test_another_service_account_is_refused(policy, run):
    for obj, pod, account in ((run.js(), run.controller_pod, "prefect-worker-actor-gpu"),
                              (run.js(), run.controller_pod, "rlhf-critic"),  # a JobSet's pods run as the actor's
                              (run.lws(), run.node_pod, "rlhf-actor"),  # a server's as the servers' (no RBAC)
                              (run.lws(), run.node_pod, "default")):
        _pod_spec(obj)["serviceAccountName"] = account
        _refused(policy, _created_by(obj, pod), "run as service account")
    obj = run.lws()
    _pod_spec(obj)["serviceAccount"] = "prefect-worker-actor-gpu"  # the deprecated field names an account too
    _refused(policy, _created_by(obj, run.node_pod), "run as service account")


def test_another_runs_secret_is_refused(policy, run):
    theirs = Run(OTHER).secret("critic")["metadata"]["name"]
    obj = run.lws()  # mounted
    next(v for v in _pod_spec(obj)["volumes"] if v["name"] == "run-secret")["secret"]["secretName"] = theirs
    _refused(policy, _created_by(obj, run.node_pod), "mount only .* the run's own Secrets")
    obj = run.js()  # read into the environment
    _pod_spec(obj)["containers"][0]["env"].append({"name": "STOLEN", "valueFrom": {"secretKeyRef": {
        "name": theirs, "key": "secret"}}})
    _refused(policy, _created_by(obj, run.controller_pod), "read only the run's own Secrets")
    obj = run.lws()
    _pod_spec(obj)["containers"][0]["envFrom"] = [{"secretRef": {"name": "prefect-worker-api-key"}}]
    _refused(policy, _created_by(obj, run.node_pod), "read only the run's own Secrets")
    # a Secret named after another run's Job cannot be made either
    secret = run.secret()
    secret["metadata"]["name"] = theirs
    _refused(policy, _created_by(secret, run.node_pod), "Secret is of type Opaque and named")


@pytest.mark.parametrize("change, rule", [
    (lambda s: s.update(hostNetwork=True), "no host namespace"),
    (lambda s: s.update(hostPID=True), "no host namespace"),
    (lambda s: s.update(nodeName="ip-10-40-0-7.ec2.internal"), "nodeName"),
    (lambda s: s.update(priorityClassName="system-node-critical"), "priorityClassName"),
    (lambda s: s["securityContext"].update(runAsNonRoot=False), "non-root"),
    (lambda s: s["securityContext"].update(runAsUser=0), "non-root"),
    (lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}), "RuntimeDefault seccomp"),
    (lambda s: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "65536"}]), "no sysctls"),
    (lambda s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True), "no privilege escalation"),
    (lambda s: s["containers"][0]["securityContext"].update(capabilities={"add": ["NET_ADMIN"], "drop": ["ALL"]}),
     "add none"),
    (lambda s: s["containers"][0]["securityContext"].update(capabilities={}), "drop ALL"),
    (lambda s: s["containers"][0]["securityContext"].update(runAsUser=0), "never run as root"),
    (lambda s: s["containers"][0]["ports"].append({"containerPort": 80, "hostPort": 80}), "no host port"),
    (lambda s: s["containers"][0].update(image="docker.io/library/busybox:1.36"), "images of the project"),
    (lambda s: s["containers"][0].update(image=f"{REGISTRY}/rlhf-flows-evil:1"), "images of the project"),
    (lambda s: s["volumes"].append({"name": "x", "persistentVolumeClaim": {"claimName": "other-claim"}}),
     "the claim rlhf-cache"),
    (lambda s: s["volumes"].append({"name": "x", "projected": {"sources": [{"serviceAccountToken": {
        "path": "token", "audience": "other"}}]}}), "mount only emptyDir"),
])
def test_a_pod_that_could_reach_beyond_its_run_is_refused(policy, run, change, rule):
    for obj, pod in ((run.js(), run.controller_pod), (run.lws("rollout"), run.node_pod)):
        change(_pod_spec(obj))
        _refused(policy, _created_by(obj, pod), rule)


def test_pod_labels_and_annotations_are_the_runs_own(policy, run):
    obj = run.lws()  # a server's pods taking the label another run's policies let in
    obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]["batch.kubernetes.io/job-name"] = OTHER
    _refused(policy, _created_by(obj, run.node_pod), "carry its labels")
    obj = run.lws()
    obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]["rlhf/run"] = OTHER
    _refused(policy, _created_by(obj, run.node_pod), "carry its labels")
    obj = run.js()
    obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["annotations"] = {
        "container.apparmor.security.beta.kubernetes.io/main": "unconfined"}
    _refused(policy, _created_by(obj, run.controller_pod), "carry its labels")
    obj = run.lws()  # what Kueue's webhook adds to a LeaderWorkerSet's templates is allowed
    obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["annotations"] = {
        "kueue.x-k8s.io/pod-suspending-parent": "leaderworkerset.x-k8s.io/leaderworkerset",
        "kueue.x-k8s.io/pod-group-serving": "true"}
    assert policy.admit(_created_by(obj, run.node_pod)).allowed


def test_leader_worker_sets_without_the_api_token_and_claims_of_their_own(policy, run):
    obj = run.lws()
    _pod_spec(obj)["automountServiceAccountToken"] = True
    _refused(policy, _created_by(obj, run.node_pod), "automountServiceAccountToken false")
    obj = run.lws()
    obj["spec"]["leaderWorkerTemplate"]["volumeClaimTemplates"] = [{"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Ti"}}}}]
    _refused(policy, _created_by(obj, run.node_pod), "claims no volumes")


def test_jobsets_of_one_indexed_node_job_without_claims(policy, run):
    for change in (lambda js: js["spec"].update(volumeClaimPolicies=[{"templates": [{"metadata": {"name": "d"}}]}]),
                   # a Job named <victim's Job>-0 whose pods' names read as the victim's Indexed pods
                   lambda js: js["spec"]["replicatedJobs"][0].update(name="heron-x7k2q"),
                   lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(completionMode="NonIndexed"),
                   lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(manualSelector=True),
                   lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(completions=30000)):
        obj = run.js()
        change(obj)
        _refused(policy, _created_by(obj, run.controller_pod), "one replicated job `node`")


# ------------------------------------------------------------------------------------------------ refused: whose
def test_objects_of_another_job_are_refused(policy, run):
    other = Run(OTHER)
    for obj, pod in ((other.js(), run.controller_pod), (other.lws(), run.node_pod), (other.secret(), run.node_pod),
                     (other.server_policies[0], run.node_pod)):
        _refused(policy, _created_by(obj, pod), "must be labelled rlhf/run=<the Job that pod")
    obj = run.lws()  # the run's label, another Job as its owner
    obj["metadata"]["ownerReferences"][0]["name"] = OTHER
    _refused(policy, _created_by(obj, run.node_pod), "owned by its run's Job")
    obj = run.lws()  # owned by the run's Job and by another's
    obj["metadata"]["ownerReferences"].append({**obj["metadata"]["ownerReferences"][0], "name": OTHER})
    _refused(policy, _created_by(obj, run.node_pod), "and by nothing else")
    # node group 1 does not run the run (only node group 0's rank 0 creates its servers); a token bound to no pod
    # acts for no run
    _refused(policy, _created_by(run.lws(), run.node_pod.replace("-0-xz2q4", "-1-xz2q4")), "must be labelled")
    _refused(policy, Request("CREATE", run.lws(), pod=None), "bound to no pod")


def test_deleting_what_the_runs_job_does_not_own_is_refused(policy, run):
    other = Run(OTHER)
    victims = [other.jobset, other.lws(), other.secret(), other.server_policies[0],
               {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",  # the namespace's default deny
                "metadata": {"name": "rlhf-default-deny", "labels": {"app.kubernetes.io/part-of": "rlhf-flows"}},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}},
               {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "prefect-api-key"}, "type": "Opaque"}]
    for victim in victims:
        decision = policy.admit(Request("DELETE", None, old_object=victim, pod=run.node_pod))
        assert decision.applied and not decision.allowed, victim["metadata"]["name"]
    # labelled as the run's, but owned by another Job
    obj = other.lws()
    obj["metadata"]["labels"]["rlhf/run"] = run.nodes
    _refused(policy, Request("DELETE", None, old_object=obj, pod=run.node_pod), "owned by its run's Job")


def test_an_update_never_moves_an_object_to_another_run(policy, run):
    theirs, mine = Run(OTHER).lws(), run.lws()
    mine["metadata"]["name"] = theirs["metadata"]["name"]
    _refused(policy, Request("UPDATE", mine, old_object=theirs, pod=run.node_pod), "never whose they are")
    assert policy.admit(Request("UPDATE", run.lws(), old_object=run.lws(), pod=run.node_pod)).allowed


def test_a_service_account_token_secret_is_refused(policy, run):
    """Kubernetes fills a Secret of this type with a token of the account it names: the Prefect worker's could
    create any Job."""
    secret = run.secret()
    secret["type"] = "kubernetes.io/service-account-token"
    secret["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "prefect-worker-actor-gpu"}
    _refused(policy, _created_by(secret, run.node_pod), "type Opaque")


@pytest.mark.parametrize("change", [
    lambda p: p["spec"]["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
    lambda p: p["spec"]["egress"][0]["to"].append({"namespaceSelector": {}}),
    lambda p: p["spec"]["ingress"].append({"ports": [{"port": 8000}]}),  # no peers: from anywhere
    lambda p: p["spec"]["ingress"][0]["from"].append({"podSelector": {}}),  # every pod of the namespace
    lambda p: p["spec"]["ingress"][0]["from"].append({"podSelector": {"matchLabels": {"rlhf/run": OTHER}}}),
    lambda p: p["spec"].update(podSelector={}),  # opening every pod of the namespace
    lambda p: p["spec"].update(podSelector={"matchLabels": {"rlhf/role": "critic"}}),
    lambda p: p["metadata"].update(name=f"rlhf-{OTHER}-run"),  # taking another run's policy's name first
])
def test_network_policies_that_reach_beyond_the_run_are_refused(policy, run, change):
    network_policy = copy.deepcopy(run.server_policies[0])
    change(network_policy)
    _refused(policy, _created_by(network_policy, run.node_pod), "NetworkPolicy is named")


# ------------------------------------------------------------------------------------------------ scope
def test_requests_of_anyone_but_the_runs_accounts_are_not_the_policys(policy, run):
    for username in ("system:serviceaccount:rlhf:prefect-worker-actor-gpu",  # creates the flow-run Jobs
                     "system:serviceaccount:kube-system:generic-garbage-collector",  # deletes what a Job owned
                     "system:serviceaccount:other:rlhf-actor",  # the same name in another namespace
                     "arn:aws:iam::123456789012:role/admin"):
        request = Request("DELETE", None, old_object=run.lws(), username=username, pod=None)
        assert not policy.admit(request).applied, username
    assert policy.admit(Request("CREATE", run.lws(), pod=run.node_pod), namespace_labels={
        "kubernetes.io/metadata.name": "elsewhere"}).applied is False
    assert policy.admit(Request("CREATE", run.lws(), username="system:serviceaccount:rlhf:rlhf-critic",
                                pod=run.node_pod)).applied  # the servers' account is held to it too


def test_the_evaluator_decides_as_the_api_server_does():
    """The semantics the tests above rely on, on small policies: a false matchCondition skips the policy, an error
    in one refuses (failurePolicy Fail); a false validation refuses with its messageExpression, a multi-line one
    falls back to the static message; an error in a variable refuses only where it is used; Audit alone refuses
    nothing."""
    def policy_of(conditions, validations, variables=(), actions=("Deny",)):
        rule = {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["secrets"], "operations": ["CREATE"]}
        return AdmissionPolicy(
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
             "metadata": {"name": "p"}, "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [rule]},
                                                  "matchConditions": list(conditions), "variables": list(variables),
                                                  "validations": list(validations)}},
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
             "metadata": {"name": "p"}, "spec": {"policyName": "p", "validationActions": list(actions)}})

    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    request = Request("CREATE", secret, pod="x-bcdfg")
    ok = {"expression": "true"}
    assert not policy_of([{"name": "c", "expression": "false"}], [{"expression": "false"}]).admit(request).applied
    assert not policy_of([{"name": "c", "expression": "object.nope == 1"}], [ok]).admit(request).allowed
    named = {"expression": "object.metadata.name == 't'", "messageExpression": "'not ' + object.metadata.name"}
    decision = policy_of([], [named]).admit(request)
    assert not decision.allowed and decision.messages == ["not s"]
    two_lines = {"expression": "false", "message": "static", "messageExpression": "'a\\nb'"}
    decision = policy_of([], [two_lines]).admit(request)
    assert decision.messages == ["static"]
    variables = [{"name": "bad", "expression": "object.nope"}, {"name": "good", "expression": "object.metadata.name"}]
    assert policy_of([], [{"expression": "variables.good == 's'"}], variables).admit(request).allowed
    assert not policy_of([], [{"expression": "variables.bad == 's'"}], variables).admit(request).allowed
    assert policy_of([], [{"expression": "false"}], actions=("Audit",)).admit(request).allowed
    assert Request("CREATE", secret).as_cel()["resource"] == {"group": "", "version": "v1", "resource": "secrets"}
