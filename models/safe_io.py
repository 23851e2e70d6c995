"""Reading checkpoint files without running code from them.

A checkpoint can come from a store other runs may write (a shared S3 prefix), so nothing in it may be a pickle that
builds arbitrary objects: a pickle names callables, and unpickling calls them. What our checkpoints hold:
- model weights: safetensors (save_pretrained), read by transformers;
- small state (schedules, counters, RNG states, the prompt stream): torch.save files, read back with
  `torch.load(weights_only=True)` (`load_state`): torch's restricted unpickler, tensors and plain containers only;
- optimizer states and per-rank sampling streams: torch.distributed.checkpoint (DCP). Its tensor files are read with
  weights_only=True, but its `.metadata` file is a plain pickle that DCP's FileSystemReader unpickles as it is.
  `dcp_load` reads it with an unpickler that builds only DCP's own metadata classes and a few torch and stdlib types
  (`_MetadataUnpickler.find_class`); anything else is refused naming it.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from enum import Enum
from pathlib import Path

import torch

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PLAIN = {("collections", "OrderedDict"): collections.OrderedDict, ("pathlib", "PosixPath"): pathlib.PosixPath,
          ("pathlib", "PurePosixPath"): pathlib.PurePosixPath, ("torch", "Size"): torch.Size,
          ("torch.serialization", "_get_layout"): torch.serialization._get_layout}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names something it may not build."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata only: DCP's dataclasses and enums, torch dtypes/Size/layouts, plain containers."""

    def find_class(self, module: str, name: str):
        if (module, name) in _PLAIN:
            return _PLAIN[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULES) and "." not in name:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) and (hasattr(found, "__dataclass_fields__") or issubclass(found, Enum)):
                return found
        raise UnsafeCheckpoint(f"checkpoint metadata names {module}.{name}, which a checkpoint may not build "
                               f"(only torch.distributed.checkpoint's metadata)")


def load_state(path: str | Path) -> dict:
    """A torch.save file of tensors and plain values, read without building anything else."""
    return torch.load(path, map_location="cpu", weights_only=True)


def dcp_load(state_dict: dict, directory: str | Path, no_dist: bool = False) -> None:
    """torch.distributed.checkpoint.load of `directory` into `state_dict` (in place), its metadata unpickled safely;
    `no_dist`: this process alone, whatever process group it has (a one-rank critic beside a multi-rank actor)."""
    import torch.distributed.checkpoint as dcp  # heavy (~1.7 s): only checkpoints need it

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta  # heavy: as dcp above

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    metadata = Path(directory) / ".metadata"
    if metadata.is_file():  # refused here, naming it (inside dcp.load the error would come wrapped per rank)
        with open(metadata, "rb") as stream:
            _MetadataUnpickler(stream).load()
    dcp.load(state_dict, storage_reader=SafeReader(str(directory)), no_dist=no_dist)
