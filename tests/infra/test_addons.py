"""Static checks of what infra/terraform installs inside the cluster (modules/addons, registry, cache): every Helm
chart pinned to an exact version that exists upstream at the tag the vendored CRD schemas come from; every kind a run
creates has its controller installed; the Kueue queues, rendered as Terraform renders them, are valid objects sized
to the pools and named as the run's config expects; the images' repositories and the cache volume as the pods use
them. (checkov scans these modules in test_terraform.)"""

from __future__ import annotations

import json
import re

import pytest

from components.cluster.objects import QUEUE_LABEL
from models.deploy import ClusterPlacement
from tests.infra.schemas import CRD_FILES, validate
from tests.infra.test_terraform import (ENV_DEV, MODULES, PREFECT_YAML, TF, _blocks, _locals, _one, _render_template,
                                        _resources, yaml)

pytestmark = pytest.mark.fast

ADDONS = MODULES / "addons"
KUEUE_TEMPLATE = ADDONS / "templates" / "kueue_queues.json.tftpl"
CONTROLLERS = {"JobSet": "jobset", "LeaderWorkerSet": "lws", "ResourceFlavor": "kueue", "ClusterQueue": "kueue",
               "LocalQueue": "kueue", "Workload": "kueue"}


def _chart_versions() -> dict[str, str]:
    return _blocks(ADDONS, "variable")["chart_versions"]["default"]


def _releases() -> dict[str, dict]:
    return {name: body for (rtype, name), body in _resources(ADDONS).items() if rtype == "helm_release"}


def _version(body: dict) -> str:
    ref = re.fullmatch(r"\$\{var\.chart_versions\.(\w+)\}", body.get("version", ""))
    return _chart_versions()[ref.group(1)] if ref else body.get("version", "")


def test_every_helm_release_is_pinned_to_an_exact_version():
    releases = _releases()
    assert {"nvidia_device_plugin", "cluster_autoscaler", "jobset", "lws", "kueue", "kueue_queues",
            "prefect_worker"} == set(releases)
    for name, body in releases.items():
        if body["chart"].startswith("${path.module}/"):  # the local chart of the queues: its version is in the tree
            assert (ADDONS / body["chart"].removeprefix("${path.module}/") / "Chart.yaml").is_file(), name
            continue
        assert re.fullmatch(r"\d+\.\d+\.\d+", _version(body)), f"helm_release {name}: {_version(body)!r} is not pinned"
    oci = {name: body["repository"] for name, body in releases.items()
           if body.get("repository", "").startswith("oci://")}
    assert oci == {"jobset": "oci://registry.k8s.io/jobset/charts", "lws": "oci://registry.k8s.io/lws/charts",
                   "kueue": "oci://registry.k8s.io/kueue/charts"}
    validation = _one(_blocks(ADDONS, "variable")["chart_versions"]["validation"])
    assert "[0-9]+\\\\.[0-9]+\\\\.[0-9]+$" in validation["condition"]  # a range is refused at plan time


def test_every_kind_a_run_creates_has_its_controller_installed_at_the_version_its_schema_comes_from():
    """The JobSet and LeaderWorkerSet a run creates and the Kueue objects: their charts are installed, and the CRD
    schemas the tests validate against (tests/infra/crds) are those of the pinned chart versions."""
    releases, versions = _releases(), {"jobset": None, "lws": None, "kueue": None}
    for name in versions:
        versions[name] = _version(releases[name])
    for (group, kind), file in CRD_FILES.items():
        chart = CONTROLLERS[kind]
        assert chart in releases, f"{kind} objects are created but chart {chart} is not installed"
        assert file.startswith(f"{chart}-v{versions[chart]}-"), f"{file}: not the schema of {chart} {versions[chart]}"
    assert "depends_on" in releases["kueue_queues"]
    assert "helm_release.kueue" in str(releases["kueue_queues"]["depends_on"])


def _queues(max_sizes=(2, 3)) -> list[dict]:
    pools = {"actor": {"max_size": max_sizes[0], "gpus": 1, "vcpu": 4, "memory_gib": 16},
             "critic": {"max_size": max_sizes[1], "gpus": 1, "vcpu": 4, "memory_gib": 16}}
    quota = {role: {"cpu": str(p["max_size"] * p["vcpu"]), "memory": f"{p['max_size'] * p['memory_gib']}Gi",
                    "gpus": str(p["max_size"] * p["gpus"])} for role, p in pools.items()}
    return _render_template({"queue": "rlhf", "namespace": "rlhf", "actor_quota": quota["actor"],
                             "critic_quota": quota["critic"]}, KUEUE_TEMPLATE)


def test_the_kueue_queues_are_valid_sized_to_the_pools_and_named_as_the_runs_expect():
    objects = _queues()
    for obj in objects:
        validate(obj)
    flavors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ResourceFlavor"}
    assert {name: f["spec"]["nodeLabels"] for name, f in flavors.items()} == {"actor": {"rlhf/role": "actor"},
                                                                             "critic": {"rlhf/role": "critic"}}
    (cluster_queue,) = [o for o in objects if o["kind"] == "ClusterQueue"]
    (group,) = cluster_queue["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]  # every resource a run's pods request
    quotas = {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in group["flavors"]}
    assert quotas == {"actor": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "2"},
                      "critic": {"cpu": "12", "memory": "48Gi", "nvidia.com/gpu": "3"}}
    (local_queue,) = [o for o in objects if o["kind"] == "LocalQueue"]
    assert (local_queue["metadata"]["name"] == ClusterPlacement().queue
            == _blocks(ENV_DEV, "variable")["queue_name"]["default"])
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]
    # Terraform computes the same quotas from the pools' variables and node_types.json
    quota_expr = str(_locals(ADDONS)["quotas"])
    assert "pool.max_size * pool.gpus_per_node" in quota_expr and "var.node_types" in quota_expr
    assert QUEUE_LABEL == "kueue.x-k8s.io/queue-name"


def test_an_invalid_queue_is_caught():
    objects = _queues()
    cluster_queue = next(o for o in objects if o["kind"] == "ClusterQueue")
    cluster_queue["spec"]["queueingStrategy"] = "FirstComeFirstServed"
    with pytest.raises(AssertionError, match="queueingStrategy"):
        validate(cluster_queue)


def test_one_prefect_worker_per_pool_on_the_projects_prefect_version():
    release = _releases()["prefect_worker"]
    assert release["for_each"] == "${toset(var.work_pools)}"
    work_pools = _blocks(ENV_DEV, "module")["addons"]["work_pools"]
    assert work_pools == ["${module.prefect.actor_work_pool_name}", "${module.prefect.critic_work_pool_name}"]
    tag = _blocks(ADDONS, "variable")["prefect_worker_image_tag"]["default"]
    assert tag.startswith(yaml.safe_load(PREFECT_YAML.read_text())["prefect-version"] + "-")


def test_the_image_repositories_are_immutable_scanned_and_encrypted():
    repository = _resources(MODULES / "registry")[("aws_ecr_repository", "this")]
    assert repository["image_tag_mutability"] == "IMMUTABLE"
    assert _one(repository["image_scanning_configuration"])["scan_on_push"] is True
    encryption = _one(repository["encryption_configuration"])
    assert encryption["encryption_type"] == "KMS" and "aws_kms_key.this" in encryption["kms_key"]
    assert _blocks(MODULES / "registry", "variable")["repositories"]["default"] == ["rlhf-flows", "rlhf-flows-vllm"]


def test_the_cache_volume_is_the_one_every_pod_mounts():
    cache = _resources(MODULES / "cache")
    efs = cache[("aws_efs_file_system", "this")]
    assert efs["encrypted"] is True and "aws_kms_key.this" in efs["kms_key_id"]
    claim = cache[("kubernetes_persistent_volume_claim_v1", "cache")]
    assert _one(claim["spec"])["access_modes"] == ["ReadWriteMany"]
    defaults = {ClusterPlacement().cache_claim, _blocks(MODULES / "cache", "variable")["claim_name"]["default"],
                _blocks(MODULES / "prefect", "variable")["cache_claim"]["default"],
                _blocks(ENV_DEV, "variable")["cache_claim_name"]["default"]}
    assert defaults == {"rlhf-cache"}
    assert (ClusterPlacement().cache_mount == _blocks(MODULES / "prefect", "variable")["cache_mount"]["default"]
            == "/cache")
    assert ClusterPlacement().state_dir == _blocks(MODULES / "prefect", "variable")["state_dir"]["default"]
    storage_class = cache[("kubernetes_storage_class_v1", "efs")]
    assert storage_class["parameters"]["uid"] == "1000"  # the images' user (docker/actor.Dockerfile)
    ingress = _one(cache[("aws_security_group", "efs")]["ingress"])
    assert (ingress["from_port"], ingress["to_port"], ingress["cidr_blocks"]) == (2049, 2049, ["${var.vpc_cidr_block}"])


def test_the_infra_readme_comes_down_to_apply_build_and_deploy():
    text = (TF / "README.md").read_text()
    for step in ("terraform apply", "make image", "docker push", "prefect deploy --all"):
        assert step in text, step
    assert "<pinned>" not in text and "helm upgrade --install" not in text
    assert json.dumps(_chart_versions()["kueue"]).strip('"') in text
