"""`rlhf cluster manifests [--config FILE] [--set ...] --out DIR`: every Kubernetes object a run of this config would
create on its cluster, written as YAML for review, `kubectl apply --dry-run=server -f DIR`, or GitOps.

The objects come from the same builders the live path uses (components/cluster/objects.py): the JobSet of the actor's
node groups (deploy.actor.nnodes > 1 with deploy.actor.launch=jobset), each server's Secret and LeaderWorkerSet
(launch=kubernetes), the run's NetworkPolicies. What only a live run knows is shown as a placeholder: the run's
secret (never written anywhere), the IP of the pod that runs the run; owner references are left out (they name the
uid of the flow run's Job). Images and the namespace: deploy.cluster, else $RLHF_IMAGE / $RLHF_VLLM_IMAGE.
"""

from __future__ import annotations

import os
from pathlib import Path

from components.cli.files import load_cli_config
from components.cluster.objects import RunIdentity, Site, dumps, run_manifests
from components.controller import node_spec
from models.config import run_name_for


def cmd_manifests(args) -> int:
    cfg = load_cli_config(args)
    site = Site.of(cfg.deploy.cluster, os.environ)
    run_name = run_name_for(cfg)
    identity = RunIdentity.of(run_name, "manifests")
    actor = cfg.deploy.actor
    store = f"{(cfg.deploy.checkpoint.uri or '<deploy.checkpoint.uri>').rstrip('/')}/{run_name}"
    nodes = node_spec(cfg, run_name, store) if actor.nnodes > 1 and actor.launch == "jobset" else None
    objects = run_manifests(cfg, site, identity, nodes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, obj in enumerate(objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(dumps([obj]))
        print(path)
    if not objects:
        print(f"run {run_name}: nothing to create on a cluster (deploy.actor.launch={actor.launch}, servers: "
              f"{', '.join(f'{k}={getattr(cfg.deploy, k).launch}' for k in ('critic', 'reward', 'rollout'))})")
    return 0
