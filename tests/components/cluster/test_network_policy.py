"""Per-run NetworkPolicies (components/cluster/network_policy.py): which Job a pod runs in, the two policies a run
creates (its servers take traffic from its own Job's pods only, and the other way round), owned by the Job, created
once for all the run's servers and deleted after the last one. The Kubernetes API cannot run here: a recording
stand-in takes its calls (the client's own calls against a stand-in API server: tests/components/cluster)."""

from __future__ import annotations

import pytest

from components.cluster.network_policy import JOB_LABEL, RUN_LABEL, RunPolicies, own_job, policies


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


def test_a_runs_policies_let_only_its_own_job_reach_its_servers_and_back():
    servers, trainer = policies("ppo-x7k2q", "rlhf", job_uid="1234-uid")
    assert servers["spec"]["podSelector"] == {"matchLabels": {RUN_LABEL: "ppo-x7k2q"}}
    assert servers["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: "ppo-x7k2q"}}},
                                                    {"podSelector": {"matchLabels": {RUN_LABEL: "ppo-x7k2q"}}}]}]
    assert trainer["spec"]["podSelector"] == {"matchLabels": {JOB_LABEL: "ppo-x7k2q"}}
    assert trainer["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {RUN_LABEL: "ppo-x7k2q"}}}]}]
    for policy in (servers, trainer):
        assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["metadata"]["namespace"] == "rlhf"
        owner = policy["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Job", "ppo-x7k2q", "1234-uid")  # removed with it
        assert "namespaceSelector" not in str(policy)  # nothing outside the namespace


class RecordingAPI:
    """Stands in for the Kubernetes API (what cannot run here): records the calls."""

    calls: list = []

    def __init__(self):
        self.namespace = "rlhf"

    def job_uid(self, job):
        self.calls.append(("get job", job))
        return "uid-1"

    def create(self, manifest):
        self.calls.append(("create", manifest["metadata"]["name"]))

    def delete(self, name):
        self.calls.append(("delete", name))


def test_policies_are_created_for_the_first_server_and_deleted_after_the_last():
    RecordingAPI.calls = []
    run = RunPolicies(api_factory=RecordingAPI)
    run.acquire("ppo-x7k2q")  # the critic server
    run.acquire("ppo-x7k2q")  # the rollout server
    assert RecordingAPI.calls == [("get job", "ppo-x7k2q"), ("create", "rlhf-ppo-x7k2q-servers"),
                                  ("create", "rlhf-ppo-x7k2q-trainer")]
    run.release()
    assert ("delete", "rlhf-ppo-x7k2q-servers") not in RecordingAPI.calls  # the rollout server still serves
    run.release()
    assert RecordingAPI.calls[-2:] == [("delete", "rlhf-ppo-x7k2q-servers"), ("delete", "rlhf-ppo-x7k2q-trainer")]
