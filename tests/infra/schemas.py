"""Validation of Kubernetes objects against the real schemas, offline: core kinds with kubernetes-validate (the
Kubernetes OpenAPI schemas of a chosen version, strict: unknown fields are errors), the JobSet, LeaderWorkerSet and
Kueue kinds against their CRDs' openAPIV3Schema (tests/infra/crds: the chart versions infra/terraform installs) with
jsonschema, every object schema closed as the API server's strict field validation closes it (`kubectl apply`'s
default). A CRD's pod template is checked by its CRD schema, and once more, as a Pod, by kubernetes-validate."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jsonschema
import kubernetes_validate

CRDS = Path(__file__).parent / "crds"
KUBERNETES_VERSIONS = ("1.32", "1.35")  # the floor, and infra/terraform's kubernetes_version default
CRD_FILES = {("jobset.x-k8s.io", "JobSet"): "jobset-v0.12.0-jobsets.json",
             ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): "lws-v0.10.0-leaderworkersets.json",
             ("kueue.x-k8s.io", "ResourceFlavor"): "kueue-v0.19.2-resourceflavors.json",
             ("kueue.x-k8s.io", "ClusterQueue"): "kueue-v0.19.2-clusterqueues.json",
             ("kueue.x-k8s.io", "LocalQueue"): "kueue-v0.19.2-localqueues.json"}


def _closed(node):
    """The schema with every object that lists its properties closed to others (as strict field validation)."""
    if isinstance(node, dict):
        node = {k: _closed(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


@functools.lru_cache(maxsize=None)
def crd_schema(group: str, kind: str) -> tuple[str, dict]:
    """(version, closed openAPIV3Schema) of a vendored CRD."""
    data = json.loads((CRDS / CRD_FILES[(group, kind)]).read_text())
    schema = _closed(data["openAPIV3Schema"])
    # metadata is an ObjectMeta the API server checks itself: the CRD schema says only `type: object`
    schema.get("properties", {}).get("metadata", {}).pop("additionalProperties", None)
    return data["version"], schema


def pod_templates(obj: dict) -> list[dict]:
    """The pod templates inside a JobSet or LeaderWorkerSet."""
    if obj["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["workerTemplate"]] + ([lwt["leaderTemplate"]] if "leaderTemplate" in lwt else [])
    return []


def validate(obj: dict, versions=KUBERNETES_VERSIONS) -> None:
    """Raise naming the object and the first problem when `obj` is not valid for its kind."""
    where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    group, _, version = obj["apiVersion"].rpartition("/")
    if (group, obj["kind"]) in CRD_FILES:
        served, schema = crd_schema(group, obj["kind"])
        assert version == served, f"{where}: apiVersion {obj['apiVersion']}, the CRD serves {group}/{served}"
        try:
            jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
        except jsonschema.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {'/'.join(map(str, exc.absolute_path))}") from None
        for template in pod_templates(obj):
            validate({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": "template", **template.get("metadata", {})},
                      "spec": copy.deepcopy(template["spec"])}, versions)
        return
    for kubernetes in versions:
        try:
            kubernetes_validate.validate(obj, kubernetes, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where} (Kubernetes {kubernetes}): {exc.message} at "
                                 f"{'/'.join(map(str, exc.path))}") from None
