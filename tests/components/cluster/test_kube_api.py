"""The flow's side of the cluster path against a stand-in Kubernetes API (no cluster runs here): a small real HTTP
server on 127.0.0.1 answering the paths our client calls, with statuses the test scripts, recording every request.
The `kubernetes` client talks to it through a kubeconfig the test writes, as it would to a cluster.

What is asserted: the requests the code sends (their bodies validated against the CRD schemas), the JobSet and
LeaderWorkerSet states it reads and how it reports them (Kueue admission with the Workload's reason, pods waiting for
a node, a failed node group with its exit code and log tail, restarts), the API's refusals turned into messages
naming the object, and the clean-up: the objects deleted when the run is cancelled or fails. Where a test says so, the
stand-in admits or refuses each create and delete as the API server would with infra/terraform's admission policy
(tests/infra/admission.py evaluates it) for a request from the pod of the run's Job: what the live path sends is
admitted, and a refusal reaches the run naming the policy's rule."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from components.cluster.jobset import JobSetNodes
from components.cluster.kube import Kube, KubeError
from components.cluster.servers import KubeServers, start_servers
from components.launch.nodes import NodeSpec
from components.launch.processes import Health, ServerNotReady
from models.config import load_config
from tests.infra.admission import AdmissionPolicy, Request
from tests.infra.schemas import validate
from tests.infra.test_admission_policy import TEMPLATE, VALUES
from tests.infra.test_terraform import _render_template

NS = "rlhf"


class StandIn:
    """The API paths a run calls. `objects[(plural, name)]` holds what was created; `script[(plural, name)]` a list
    of answers to GET (each GET takes the next; the last stays); `pods` a callable giving the pod list for a label
    selector; `refuse[(method, plural)]` a status to answer instead; `admission` (an AdmissionPolicy, the pod the
    requests' token is bound to) decides creates and deletes as the API server would."""

    def __init__(self):
        self.requests, self.objects, self.script, self.refuse = [], {}, {}, {}
        self.pods = lambda selector: []
        self.workloads = []
        self.logs = {}
        self.admission = None
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, body):
                data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with stand_in.lock:
                    stand_in.requests.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                              "body": body, "auth": self.headers.get("Authorization")})
                    status, answer = stand_in.answer(self.command, url.path.split("/"), parse_qs(url.query), body)
                self._answer(status, answer)

            do_GET = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, method, parts, query, body):
        # /api/v1/namespaces/NS/PLURAL[/NAME[/log]] or /apis/GROUP/VERSION/namespaces/NS/PLURAL[/NAME]
        rest = parts[parts.index("namespaces") + 2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
        if (method, plural) in self.refuse:
            status = self.refuse[(method, plural)]
            return status, {"kind": "Status", "message": f"refused ({status})", "code": status}
        if refused := self.admission_refuses(method, plural, name, body):
            return 403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403, "message": refused}
        if method == "POST":
            key = (plural, body["metadata"]["name"])
            if key in self.objects:
                return 409, {"kind": "Status", "message": "already exists", "code": 409}
            self.objects[key] = {**body, "metadata": {**body["metadata"], "uid": f"uid-{len(self.objects)}"}}
            return 201, self.objects[key]
        if method == "DELETE":
            return (200, {"kind": "Status", "status": "Success"}) if self.objects.pop((plural, name), None) \
                else (404, {"kind": "Status", "message": "not found", "code": 404})
        if sub == "log":
            return 200, self.logs.get((name, query.get("previous", ["false"])[0]), "")
        if name is None:
            selector = dict(s.split("=", 1) for s in query["labelSelector"][0].split(","))
            items = self.pods(selector) if plural == "pods" else self.workloads if plural == "workloads" else []
            return 200, {"kind": "List", "items": items}
        if (plural, name) in self.script and (plural, name) in self.objects:
            answers = self.script[(plural, name)]
            status = answers.pop(0) if len(answers) > 1 else answers[0]
            return 200, {**self.objects[(plural, name)], "status": status}
        if (plural, name) in self.objects:
            return 200, self.objects[(plural, name)]
        return 404, {"kind": "Status", "message": f"{plural} {name} not found", "code": 404}

    def admission_refuses(self, method, plural, name, body):
        """The API server's refusal of a create or delete by the admission policy, None when it admits it."""
        if self.admission is None or method not in ("POST", "DELETE"):
            return None
        policy, pod = self.admission
        if method == "POST":
            request = Request("CREATE", body, pod=pod)
        elif (plural, name) in self.objects:
            request = Request("DELETE", None, old_object=self.objects[(plural, name)], pod=pod)
        else:
            return None
        decision = policy.admit(request)
        if decision.allowed:
            return None
        return (f'{plural} "{name or body["metadata"]["name"]}" is forbidden: ValidatingAdmissionPolicy '
                f"'rlhf-run' with binding 'rlhf-run' denied request: {decision.messages[0]}")

    def sent(self, method, plural):
        return [r for r in self.requests if r["method"] == method and f"/{plural}" in r["path"]]


@pytest.fixture
def api(tmp_path, monkeypatch):
    stand_in = StandIn()
    stand_in.thread.start()
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{stand_in.server.server_port}"}}],
        "users": [{"name": "run", "user": {"token": "the-service-account-token"}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "run", "namespace": NS}}]}))
    monkeypatch.setenv("KUBECONFIG", str(config))  # what Kube() reads off the cluster (RunPolicies' own client too)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    stand_in.kube = Kube(NS, str(config))
    stand_in.objects[("jobs", "ppo-x7k2q")] = {"apiVersion": "batch/v1", "kind": "Job",
                                               "metadata": {"name": "ppo-x7k2q", "uid": "job-uid"}}
    try:
        yield stand_in
    finally:
        stand_in.server.shutdown()
        stand_in.server.server_close()


def _enforce_admission(api, pod="ppo-x7k2q-bcdfg"):
    """The stand-in decides as an API server with infra/terraform's admission policy, for requests from `pod` (a pod
    of the run's Job ppo-x7k2q), the images this module's runs use being the project's."""
    values = {**VALUES, "image_repositories": ["r/a", "r/v"]}
    api.admission = (AdmissionPolicy(*_render_template(values, TEMPLATE, yaml.safe_load)), pod)


def _cfg(**overrides):
    return load_config(None, {"model.policy": "org/policy", "model.reward": "org/reward", "rollout.engine": "vllm",
                              "deploy.actor.nnodes": 2, "deploy.actor.launch": "jobset", "deploy.actor.max_restarts": 2,
                              "deploy.cluster.image": "r/a:1", "deploy.cluster.vllm_image": "r/v:1", **overrides})


def _pod(name, index, phase="Running", attempt=0, waiting=None, terminated=None, unschedulable=None, restarts=0,
         labels=None, ready=True):
    status = {"phase": phase, "containerStatuses": [{"name": "main", "restartCount": restarts, "state": {}}],
              "conditions": [{"type": "Ready", "status": "True" if ready and phase == "Running" else "False"}]}
    if waiting:
        status["containerStatuses"][0]["state"] = {"waiting": waiting}
    if terminated:
        key = "lastState" if restarts else "state"
        status["containerStatuses"][0][key] = {"terminated": terminated}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": unschedulable[0],
                                 "message": unschedulable[1]}]
    return {"metadata": {"name": name, "labels": {"batch.kubernetes.io/job-completion-index": str(index),
                                                  "jobset.sigs.k8s.io/restart-attempt": str(attempt),
                                                  **(labels or {})}},
            "status": status}


SPEC = NodeSpec("rlhf-demo-1a2b3c", 2, 1, 29500, ["-m", "components.runs", "--store", "s3://b/rlhf/checkpoints/demo"],
                {"RLHF_DIST_BACKEND": "nccl"}, max_restarts=2)


def test_the_jobset_is_created_watched_and_deleted(api):
    _enforce_admission(api)  # the flow run's pod of Job ppo-x7k2q asks
    nodes = JobSetNodes.for_run(SPEC, _cfg(), "the-runs-secret-for-its-ranks", kube=api.kube,
                                environ={"RLHF_IMAGE": "unused"}, job="ppo-x7k2q")
    name = SPEC.name
    suspended = {"conditions": [{"type": "Suspended", "status": "True", "reason": "SuspendedJobs",
                                 "message": "jobset is suspended"}]}
    api.script[("jobsets", name)] = [
        suspended,  # Kueue holds it: its Workload says why
        {"conditions": [], "restarts": 0},  # admitted: the pods wait for a node
        {"conditions": [], "restarts": 0},  # both run
        {"conditions": [{"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts",
                         "message": "jobset failed due to reaching max number of restarts"}], "restarts": 2}]
    api.workloads = [{"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                      "message": "couldn't assign flavors to pod set node: insufficient unused quota for "
                                 "nvidia.com/gpu in flavor actor, 1 more needed"}]}}]
    stages = iter([
        [_pod(f"{name}-node-0-0-a", 0, "Running"), _pod(f"{name}-node-0-1-b", 1, "Pending", unschedulable=(
            "Unschedulable", "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."))],
        [_pod(f"{name}-node-0-0-a", 0), _pod(f"{name}-node-0-1-b", 1)],
        # group 1 ran out of memory; group 0 was stopped because of it (SIGTERM), a moment later
        [_pod(f"{name}-node-0-0-c", 0, "Failed", attempt=2, terminated={"exitCode": 143, "reason": "Error",
                                                                           "finishedAt": "2026-11-27T10:00:03Z"}),
         _pod(f"{name}-node-0-1-d", 1, "Failed", attempt=2, terminated={"exitCode": 137, "reason": "OOMKilled",
                                                                           "finishedAt": "2026-11-27T10:00:00Z"}),
         _pod(f"{name}-node-0-1-old", 1, "Failed", attempt=1, terminated={"exitCode": 1})],
    ])
    current = {"pods": []}
    api.pods = lambda selector: current["pods"] if selector == {"jobset.sigs.k8s.io/jobset-name": name} else []
    api.logs[(f"{name}-node-0-1-d", "false")] = "rank 1: CUDA out of memory\nKilled"

    nodes.start()
    (secret,) = api.sent("POST", "secrets")  # first: the run's secret, which the node groups' ranks prove
    assert secret["body"]["stringData"] == {"secret": "the-runs-secret-for-its-ranks"}
    assert secret["body"]["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    (create,) = api.sent("POST", "jobsets")
    validate(create["body"])  # what was sent is a valid JobSet (jobset.x-k8s.io/v1alpha2, the chart's CRD)
    # first the policies that let the node groups reach each other (their pods carry the controller's rlhf/run), then
    # the Secret the node pods mount
    posts = [r["path"].split("/")[-1] for r in api.requests if r["method"] == "POST"]
    assert posts == ["networkpolicies", "networkpolicies", "secrets", "jobsets"]
    assert [r["body"]["metadata"]["name"] for r in api.sent("POST", "networkpolicies")] == [
        "rlhf-ppo-x7k2q-run", "rlhf-ppo-x7k2q-job"]
    assert create["body"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"][
        "rlhf/run"] == "ppo-x7k2q"
    pod = create["body"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (secret,) = api.sent("POST", "secrets")
    secret_name = secret["body"]["metadata"]["name"]
    assert secret_name.startswith("ppo-x7k2q-") and secret_name.endswith("-nodes")  # the admission policy's pattern
    assert {"name": "run-secret", "secret": {"secretName": secret_name, "defaultMode": 0o440}} in pod["volumes"]
    assert {"name": "RLHF_RUN_SECRET_FILE", "value": "/var/run/rlhf/secret"} in pod["containers"][0]["env"]
    assert "the-runs-secret-for-its-ranks" not in json.dumps(create["body"])  # never in the pod's spec
    assert create["auth"] == "Bearer the-service-account-token"
    assert create["body"]["metadata"]["ownerReferences"][0]["uid"] == "job-uid"  # dies with the flow run's Job
    assert create["body"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rlhf"

    status = nodes.status()
    assert status.phase == "pending" and status.message.startswith("waiting for Kueue admission (queue rlhf)")
    assert "insufficient unused quota for nvidia.com/gpu" in status.message
    (workloads,) = api.sent("GET", "workloads")
    uid = api.objects[("jobsets", name)]["metadata"]["uid"]
    assert workloads["query"]["labelSelector"] == [f"kueue.x-k8s.io/job-uid={uid}"]

    current["pods"] = next(stages)
    status = nodes.status()
    assert status.phase == "pending" and "1 of 2 node groups running" in status.message
    assert f"pod {name}-node-0-1-b is not scheduled: Unschedulable: 0/3 nodes" in status.message

    current["pods"] = next(stages)
    assert nodes.status().phase == "running"

    current["pods"] = next(stages)
    status = nodes.status()
    assert status.phase == "failed" and status.restarts == 2 and status.failed_group == 1
    assert f"node group 1 (pod {name}-node-0-1-d) exited with code 137 (OOMKilled)" in status.message
    assert "ReachedMaxRestarts" in status.message and status.message.endswith("rank 1: CUDA out of memory\nKilled")
    assert api.sent("GET", f"pods/{name}-node-0-1-d/log")[0]["query"]["tailLines"] == ["50"]

    nodes.delete()
    (delete,) = api.sent("DELETE", "jobsets")
    assert delete["path"].endswith(f"/namespaces/{NS}/jobsets/{name}")
    assert delete["body"]["propagationPolicy"] == "Background"  # its Jobs and pods go with it
    deleted = [r["path"].split("/")[-1] for r in api.requests if r["method"] == "DELETE"]
    # the Secret and the policies after the JobSet
    assert deleted == [name, secret_name, "rlhf-ppo-x7k2q-run", "rlhf-ppo-x7k2q-job"]
    assert ("secrets", secret_name) not in api.objects
    nodes.delete()  # idempotent: a second delete finds nothing and says nothing
    assert len(api.sent("DELETE", "networkpolicies")) == 2


def test_a_cancelled_run_deletes_its_jobset_in_its_finally(api):
    """The controller's shape: start, watch, and whatever happens (here a cancellation), delete."""
    nodes = JobSetNodes.for_run(SPEC, _cfg(), "the-runs-secret-for-its-ranks", kube=api.kube, environ={},
                                job="ppo-x7k2q")
    api.script[("jobsets", SPEC.name)] = [{"conditions": [], "restarts": 0}]
    with pytest.raises(KeyboardInterrupt):
        try:
            nodes.start()
            nodes.status()
            raise KeyboardInterrupt  # the flow run is cancelled (SIGTERM raises in the flow process)
        finally:
            nodes.delete()
    assert [r["method"] for r in api.requests if "jobsets" in r["path"]] == ["POST", "GET", "DELETE"]
    assert ("jobsets", SPEC.name) not in api.objects


def test_the_apis_refusals_name_the_object_and_the_likely_cause(api):
    nodes = JobSetNodes.for_run(SPEC, _cfg(), "the-runs-secret-for-its-ranks", kube=api.kube, environ={},
                                job="ppo-x7k2q")
    api.refuse[("POST", "jobsets")] = 404
    with pytest.raises(KubeError, match=r"create JobSet 'rlhf-demo-1a2b3c' in namespace 'rlhf': 404 .*is JobSet "
                                        r"\(sigs.k8s.io/jobset\) installed"):
        nodes.start()
    api.refuse[("POST", "jobsets")] = 403
    with pytest.raises(KubeError, match=r"403 .*may not create JobSet objects there, or not this one \(RBAC"):
        nodes.start()
    del api.refuse[("POST", "jobsets")]
    nodes.start()
    with pytest.raises(KubeError, match="409 .*exists already"):
        nodes.start()


class ScriptedProbe:
    """Our own probe of a replica's URL (the HTTP probes themselves are tested against real servers elsewhere)."""

    def __init__(self):
        self.healthy, self.seen = False, []

    def __call__(self, url):
        def probe():
            self.seen.append(url)
            return Health(True, "ready") if self.healthy else Health(False, f"nothing listening at {url}")
        return probe


def test_servers_are_leader_worker_sets_created_waited_for_and_deleted_with_the_runs_policies(api):
    _enforce_admission(api)
    cfg = _cfg(**{"deploy.rollout.replicas": 2, "deploy.rollout.launch": "kubernetes"})
    probe = ScriptedProbe()
    server = start_servers("rollout", cfg, "the-run-secret", probe, "demo", kube=api.kube, environ={},
                           job="ppo-x7k2q", trainer_host="10.1.2.3")
    server.poll_s = 0.01
    secret, lws = api.sent("POST", "secrets")[0]["body"], api.sent("POST", "leaderworkersets")[0]["body"]
    validate(secret)
    validate(lws)
    assert secret["stringData"]["secret"] == "the-run-secret" and "the-run-secret" not in json.dumps(lws)
    assert [r["body"]["metadata"]["name"] for r in api.sent("POST", "networkpolicies")] == [
        "rlhf-ppo-x7k2q-run", "rlhf-ppo-x7k2q-job"]
    for obj in (secret, lws):
        assert obj["metadata"]["ownerReferences"][0]["name"] == "ppo-x7k2q"
    name = lws["metadata"]["name"]
    assert server.urls == [f"http://{name}-0.{name}.{NS}:8000", f"http://{name}-1.{name}.{NS}:8000"]

    def group(i, **kw):
        return _pod(f"{name}-{i}", i, labels={"leaderworkerset.sigs.k8s.io/name": name,
                                              "leaderworkerset.sigs.k8s.io/group-index": str(i)}, **kw)

    stages = iter([[group(0, phase="Pending",
                          unschedulable=("SchedulingGated",
                                         "Scheduling is blocked due to non-empty scheduling gates"))],
                   [group(0, phase="Pending", waiting={"reason": "ContainerCreating"}), group(1, phase="Pending")],
                   [group(0, ready=False), group(1, ready=False)],  # running, the model still loading
                   [group(0), group(1)]])
    pods = {"now": []}
    seen = []

    def pods_for(selector):
        assert selector == {"leaderworkerset.sigs.k8s.io/name": name}
        if len(seen) < 8:  # every look moves the scripted cluster on
            pods["now"] = next(stages, pods["now"])
        seen.append(1)
        ready = [c["status"] == "True" for p in pods["now"] for c in p["status"]["conditions"] if c["type"] == "Ready"]
        assert not probe.seen or all(ready)  # our probe looks only once Kubernetes says the pod is ready
        if pods["now"] and all(ready):
            probe.healthy = True
        return pods["now"]

    api.pods = pods_for
    health = server.wait_until_ready(30)
    assert health.ok and set(probe.seen) == set(server.urls)
    assert server.death() is None

    # replica 1's container was restarted: its state is gone, the run fails naming it
    api.logs[(f"{name}-1", "true")] = "vllm: CUDA error: an illegal memory access"
    api.pods = lambda selector: [group(0), group(1, restarts=1, terminated={"exitCode": 139, "reason": "Error"})]
    death = server.death()
    assert death.startswith(f"rollout server replica 1 (pod {name}-1, {server.urls[1]}) exited with code 139 (Error), "
                            f"restarted 1 time(s)")
    assert death.endswith("CUDA error: an illegal memory access")

    assert server.stop(2.0) == f"deleted LeaderWorkerSet {name}, Secret {secret['metadata']['name']}"
    deleted = [(r["path"].split("/")[-2], r["path"].split("/")[-1]) for r in api.requests if r["method"] == "DELETE"]
    assert deleted == [("leaderworkersets", name), ("secrets", secret["metadata"]["name"]),
                       ("networkpolicies", "rlhf-ppo-x7k2q-run"), ("networkpolicies", "rlhf-ppo-x7k2q-job")]
    assert not [k for k in api.objects if k[0] != "jobs"]  # every create and delete was admitted


def test_a_server_that_cannot_start_is_named_and_its_objects_are_deleted(api):
    cfg = _cfg(**{"deploy.critic.launch": "kubernetes"})
    probe = ScriptedProbe()
    # off a Job: no owner, no policies
    server = start_servers("critic", cfg, "s", probe, "demo", kube=api.kube, environ={})
    server.poll_s = 0.01
    name = server.lws
    api.pods = lambda selector: [_pod(f"{name}-0", 0, "Pending",
                                      waiting={"reason": "ImagePullBackOff", "message": "pull access denied"},
                                      labels={"leaderworkerset.sigs.k8s.io/group-index": "0"})]
    with pytest.raises(ServerNotReady,
                       match=r"timed out after 1s waiting for critic server replica 0 .*ImagePullBackOff: pull access "
                             r"denied"):
        server.wait_until_ready(1)
    api.pods = lambda selector: [_pod(f"{name}-0", 0, "Running", terminated={"exitCode": 1}, restarts=2,
                                      labels={"leaderworkerset.sigs.k8s.io/group-index": "0"})]
    with pytest.raises(ServerNotReady,
                       match=r"critic server replica 0 \(pod .*-0, .*\) exited with code 1, restarted 2"):
        server.wait_until_ready(5)
    server.stop(2.0)
    assert not [k for k in api.objects if k[0] in ("secrets", "leaderworkersets")]
    assert server.stop(2.0) == "nothing left to delete"  # twice: safe
    assert not api.sent("POST", "networkpolicies")
    api.refuse[("POST", "leaderworkersets")] = 422
    with pytest.raises(KubeError, match="LeaderWorkerSet .*422"):
        start_servers("critic", cfg, "s", probe, "demo", kube=api.kube, environ={})
    assert not [k for k in api.objects if k[0] == "secrets"]  # the Secret made first is deleted again
    assert isinstance(server, KubeServers)


def test_what_the_admission_policy_refuses_reaches_the_run_naming_the_rule(api):
    """A server of an image that is not the project's, and a run's attempt to delete another run's object: the API
    server's 403 carries the policy's message, and the run's error names the object and the policy."""
    _enforce_admission(api)
    cfg = _cfg(**{"deploy.critic.launch": "kubernetes", "deploy.cluster.image": "docker.io/someone/else:1"})
    with pytest.raises(KubeError, match=r"create LeaderWorkerSet .* 403 .*images of the project's repositories.*"
                                        r"admission policy"):
        start_servers("critic", cfg, "s", ScriptedProbe(), "demo", kube=api.kube, environ={}, job="ppo-x7k2q")
    assert not [k for k in api.objects if k[0] in ("secrets", "leaderworkersets")]  # its Secret deleted again
    api.objects[("leaderworkersets", "theirs")] = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": "theirs", "labels": {"rlhf/run": "calm-otter-p4q9z"}, "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "Job", "name": "calm-otter-p4q9z", "uid": "u"}]}}
    with pytest.raises(KubeError, match=r"delete LeaderWorkerSet 'theirs' .* 403 .*must be labelled rlhf/run="):
        api.kube.delete("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "theirs")
    assert ("leaderworkersets", "theirs") in api.objects
