"""Checkpoint files cannot carry code: a planted pickle in a torch.save file or in DCP's .metadata is refused, naming
what it tried to build, and nothing runs; our own files load as before."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from models.safe_io import UnsafeCheckpoint, dcp_load, load_state

MARKER = "planted-code-ran"


class Planted:
    """Unpickling this runs a shell command (what a stranger's checkpoint would do)."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


def trained_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    return model, optimizer


def test_our_own_state_and_dcp_files_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optimizer = trained_optimizer()
    generator = torch.Generator().manual_seed(3)
    torch.save({"scheduler": {"last_epoch": 2, "_last_lr": [0.01]}, "step": 5, "shuffle": generator.get_state(),
                "data": {"epoch": 1, "position": 7}}, tmp_path / "state.pt")
    state = load_state(tmp_path / "state.pt")
    assert state["step"] == 5 and state["data"] == {"epoch": 1, "position": 7}
    assert torch.equal(state["shuffle"], generator.get_state())

    saved = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": saved, "sampling_rank0": generator.get_state()}, checkpoint_id=str(tmp_path / "dcp"))
    fresh_model, fresh_optimizer = trained_optimizer()
    shards = {"optimizer": get_optimizer_state_dict(fresh_model, fresh_optimizer),
              "sampling_rank0": torch.Generator().get_state()}
    for state_of_param in shards["optimizer"]["state"].values():
        state_of_param["exp_avg"].zero_()
    dcp_load(shards, tmp_path / "dcp")
    for key, values in saved["state"].items():
        torch.testing.assert_close(shards["optimizer"]["state"][key]["exp_avg"], values["exp_avg"], rtol=0, atol=0)
    assert torch.equal(shards["sampling_rank0"], generator.get_state())


def test_a_planted_pickle_in_a_state_file_is_refused(tmp_path):
    target = tmp_path / MARKER
    torch.save({"step": 1, "scheduler": Planted(target)}, tmp_path / "actor_state.pt")
    with pytest.raises(pickle.UnpicklingError, match="system"):
        load_state(tmp_path / "actor_state.pt")
    assert not target.exists()


def test_a_planted_dcp_metadata_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optimizer = trained_optimizer()
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp_path / "dcp"))
    target = tmp_path / MARKER
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(target)))
    with pytest.raises(UnsafeCheckpoint, match=r"names posix\.system|names os\.system"):
        dcp_load({"optimizer": get_optimizer_state_dict(model, optimizer)}, tmp_path / "dcp")
    assert not target.exists()
