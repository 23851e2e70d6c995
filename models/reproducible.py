"""Whether a job's run is reproducible bit for bit, and if not why: what its summary and its MLflow tags
(`reproducible`, `reproducible.why`) say, and docs/reproducibility.md explains.

Exact: the same config, seed and machine (CPU) give the same run, every exported weight file's sha256 and every
logged metric but timings, and a run stopped after iteration k and resumed equals the run never stopped. That holds
(and the suite checks it) for PPO and every critic-free recipe, 1 and 2 ranks, 2 node groups, dynamic sampling,
the adaptive KL controller, the vLLM engine on the CPU, a TRL-protocol environment whose tools are deterministic,
and a pipeline's stages. What breaks it is listed here.
"""

from __future__ import annotations

import os
import platform

import torch

from models.loading import resolve_device


def not_exact(cfg) -> list[str]:
    """Why a run of `cfg` (an RL run's config or a stage's) is not bit-exact; [] when it is."""
    why = []
    if resolve_device(cfg.deploy.device).type == "cuda":
        why.append("a GPU (deploy.device resolves to cuda): some CUDA kernels (atomics in scatter and index ops, "
                   "cuBLAS split-K, vLLM's batching) are not deterministic")
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.max_off_policy_steps > 0:
        why.append(f"asynchronous rollouts (rollout.max_off_policy_steps={rollout.max_off_policy_steps}): which "
                   "policy version generates each batch depends on timing; a resumed run keeps every prompt once "
                   "and the staleness bound")
    environment = getattr(cfg, "environment", None)
    if environment is not None and environment.verifiers is not None:
        why.append("a verifiers environment (environment.verifiers): its own process and random state")
    return why


def reproducibility(cfg) -> dict:
    """{exact, why} of a run of `cfg`, for its summary."""
    why = not_exact(cfg)
    return {"exact": not why, "why": why}


def machine() -> str:
    """What 'the same machine' means for exactness: the CPU model, the kernels torch picked on it (AVX2, AVX-512),
    the cores, the GPU if any."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu} ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores{gpu})"


def reproducibility_tags(cfg) -> dict[str, str]:
    """The MLflow tags: reproducible=true|false and, when false, reproducible.why; the machine (what exactness is
    relative to)."""
    why = not_exact(cfg)
    return {"reproducible": "false" if why else "true", **({"reproducible.why": "; ".join(why)} if why else {}),
            "machine": machine()}
