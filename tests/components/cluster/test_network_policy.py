"""Per-run NetworkPolicies (components/cluster/network_policy.py): which Job a pod runs in, the two policies a run
creates (its pods talk to its own Job's pods and each other only, both ways), valid NetworkPolicies owned by the Job,
created once for all the run's servers and deleted after the last one, none left behind by a start that failed. The
Kubernetes API cannot run here: a recording stand-in takes its calls (the client's own calls against a stand-in API
server: tests/components/cluster/test_kube_api.py)."""

from __future__ import annotations

import pytest

from components.cluster.network_policy import JOB_LABEL, RUN_LABEL, RunPolicies, own_job, policies
from tests.infra.schemas import validate


# the downward API's labels file as the kubelet writes it for a pod of a flow run's Job (not Indexed: its hostname is
# <job>-<5 random characters>, which names no Job)
FLOW_RUN_POD = ('batch.kubernetes.io/controller-uid="4b1f0c1e-8d9e-4c55-9d3a-2f0f6f1f2a11"\n'
                'batch.kubernetes.io/job-name="ppo-x7k2q"\ncontroller-uid="4b1f0c1e-8d9e-4c55-9d3a-2f0f6f1f2a11"\n'
                'job-name="ppo-x7k2q"\nrlhf/role="actor"\nrlhf/run="none"')


def test_the_job_a_pod_runs_in_is_read_from_its_own_labels(tmp_path):
    """Whatever the pod's hostname (a work pool's flow-run Job is not Indexed): from the labels Kubernetes gives every
    pod of a Job, as the downward API writes them; on the cluster without them the run fails naming why, rather than
    creating objects owned by nothing and policies that select no pod."""
    labels = tmp_path / "labels"
    labels.write_text(FLOW_RUN_POD)
    on_cluster = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert own_job(on_cluster, str(labels)) == "ppo-x7k2q"
    assert own_job({**on_cluster, "RLHF_PODINFO_DIR": str(tmp_path)}) == "ppo-x7k2q"
    assert own_job({}, str(labels)) is None  # not on Kubernetes
    assert own_job({**on_cluster, "RLHF_NETWORK_POLICY": "off"}, str(labels)) is None
    with pytest.raises(RuntimeError, match="has no labels file .*downward API's metadata.labels"):
        own_job(on_cluster, str(tmp_path / "absent"))
    labels.write_text('rlhf/role="critic"\nrlhf/run="ppo-x7k2q"')  # a pod of no Job (a LeaderWorkerSet's)
    with pytest.raises(RuntimeError, match="name no Job"):
        own_job(on_cluster, str(labels))


def test_a_runs_policies_open_its_pods_to_its_own_pods_only_both_ways():
    run, job = policies("ppo-x7k2q", "rlhf", job_uid="1234-uid")
    own = [{"podSelector": {"matchLabels": {JOB_LABEL: "ppo-x7k2q"}}},
           {"podSelector": {"matchLabels": {RUN_LABEL: "ppo-x7k2q"}}}]
    # the run's pods (its servers, its node groups) with the Job's pods and with each other
    assert run["metadata"]["name"] == "rlhf-ppo-x7k2q-run"
    assert run["spec"]["podSelector"] == {"matchLabels": {RUN_LABEL: "ppo-x7k2q"}}
    assert run["spec"]["ingress"] == [{"from": own}] and run["spec"]["egress"] == [{"to": own}]
    # the Job's pods (the trainer) with the run's pods
    assert job["metadata"]["name"] == "rlhf-ppo-x7k2q-job"
    assert job["spec"]["podSelector"] == {"matchLabels": {JOB_LABEL: "ppo-x7k2q"}}
    assert job["spec"]["ingress"] == [{"from": own[1:]}] and job["spec"]["egress"] == [{"to": own[1:]}]
    for policy in (run, job):
        validate(policy)  # networking.k8s.io/v1, Kubernetes 1.32 and 1.35
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["metadata"]["namespace"] == "rlhf"
        owner = policy["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", "ppo-x7k2q", "1234-uid")  # removed with it
        assert "namespaceSelector" not in str(policy) and "ipBlock" not in str(policy)  # nothing outside the run


class RecordingAPI:
    """Stands in for the Kubernetes API (what cannot run here): records the calls; refuses a create whose name is in
    `refuse`."""

    calls: list = []
    refuse: set = set()

    def __init__(self):
        self.namespace = "rlhf"

    def job_uid(self, job):
        self.calls.append(("get job", job))
        return "uid-1"

    def create(self, manifest):
        if manifest["metadata"]["name"] in self.refuse:
            raise RuntimeError(f"refused {manifest['metadata']['name']}")
        self.calls.append(("create", manifest["metadata"]["name"]))

    def delete(self, name):
        self.calls.append(("delete", name))


def test_policies_are_created_for_the_first_server_and_deleted_after_the_last():
    RecordingAPI.calls, RecordingAPI.refuse = [], set()
    run = RunPolicies(api_factory=RecordingAPI)
    run.acquire("ppo-x7k2q")  # the critic server
    run.acquire("ppo-x7k2q")  # the rollout server
    assert RecordingAPI.calls == [("get job", "ppo-x7k2q"), ("create", "rlhf-ppo-x7k2q-run"),
                                  ("create", "rlhf-ppo-x7k2q-job")]
    run.release()
    assert ("delete", "rlhf-ppo-x7k2q-run") not in RecordingAPI.calls  # the rollout server still serves
    run.release()
    assert RecordingAPI.calls[-2:] == [("delete", "rlhf-ppo-x7k2q-run"), ("delete", "rlhf-ppo-x7k2q-job")]


def test_a_start_whose_policies_fail_leaves_none_behind_and_the_next_start_makes_them():
    RecordingAPI.calls, RecordingAPI.refuse = [], {"rlhf-ppo-x7k2q-job"}
    run = RunPolicies(api_factory=RecordingAPI)
    with pytest.raises(RuntimeError, match="refused rlhf-ppo-x7k2q-job"):
        run.acquire("ppo-x7k2q")
    assert RecordingAPI.calls[-2:] == [("create", "rlhf-ppo-x7k2q-run"), ("delete", "rlhf-ppo-x7k2q-run")]
    RecordingAPI.calls, RecordingAPI.refuse = [], set()
    run.acquire("ppo-x7k2q")  # the failed start held nothing: this one creates both
    assert [c for c in RecordingAPI.calls if c[0] == "create"] == [("create", "rlhf-ppo-x7k2q-run"),
                                                                   ("create", "rlhf-ppo-x7k2q-job")]
    run.release()
    assert RecordingAPI.calls[-2:] == [("delete", "rlhf-ppo-x7k2q-run"), ("delete", "rlhf-ppo-x7k2q-job")]
