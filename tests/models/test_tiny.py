"""The embedded default ships as files (models/assets/tiny): what ships is what its manifest recorded, and it loads
through `from_pretrained` as a run loads it, bit for bit the same under every CPU kernel set. (`rlhf models tiny`, the
script that made it, is checked in tests/components/cli/test_main.py.)"""

import json
import os
import subprocess
import sys

import pytest

from models.resolve import file_digests
from models.tiny_files import EMBEDDED_DIR, NAMES, embedded_model_path, manifest

CAPABILITIES = ("default", "avx2")  # the kernel sets every x86-64 machine of this kind has (AVX-512 ones have a third)

DIGESTS = """
import json, sys
from models.tiny import load_digests
import torch
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "digests": load_digests(sys.argv[1])}))
"""


def test_the_shipped_files_are_the_ones_the_manifest_recorded():
    recorded = manifest()["models"]
    assert sorted(recorded) == sorted(NAMES)
    for name in NAMES:
        assert file_digests(EMBEDDED_DIR / name) == recorded[name]["files"], name
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(recorded[name]["files"]), name


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_models_load_bit_for_bit_the_same_under_each_cpu_capability(capability):
    """Loaded through from_pretrained (the class a run uses) in a process whose torch runs the `capability` kernels:
    every state dict's sha256 is the recorded one."""
    proc = subprocess.run([sys.executable, "-c", DIGESTS, str(EMBEDDED_DIR)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, ATEN_CPU_CAPABILITY=capability))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["capability"] == capability.upper()
    assert loaded["digests"] == {name: entry["state_sha256"] for name, entry in manifest()["models"].items()}


def test_tiny_names_resolve_to_the_shipped_files_and_unknown_ones_are_refused():
    from models.config import RLHFConfig, merge
    from models.resolve import pin

    cfg = pin(RLHFConfig())
    assert cfg.local_path("model.policy") == str(EMBEDDED_DIR / "policy")
    with pytest.raises(FileNotFoundError, match="model.critic: model path '/elsewhere/policy' does not exist"):
        pin(merge(cfg, {"model.critic": "/elsewhere/policy"}))  # a missing model fails, naming its field
    with pytest.raises(FileNotFoundError, match="tiny/policy, tiny/reward, tiny/critic, tiny/reward-chars"):
        embedded_model_path("tiny/nope")
