"""Make the vendored CRD schemas of this folder from a CRD file (test data, not code the project runs):

    python tests/infra/crds/extract.py CRD.yaml VERSION OUT.json

takes the openAPIV3Schema of VERSION from the CustomResourceDefinition in CRD.yaml (a chart's crds/ file; a leading
Helm template comment is skipped), drops every `description` (most of the size: the schemas stay exactly as
strict), and writes it as compact JSON. README.md says where each file came from."""

from __future__ import annotations

import json
import re
import sys

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description" or not isinstance(v, str)}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(source: str, version: str, out: str) -> None:
    text = re.sub(r"\{\{.*?\}\}", "", open(source).read(), flags=re.S)  # Helm's template lines around the CRD
    crd = next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "CustomResourceDefinition")
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    with open(out, "w") as fh:
        json.dump({"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": version,
                   "openAPIV3Schema": strip(schema)}, fh, separators=(",", ":"), sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
