"""Objects named by a spec, 'package.module:name' (imported) or 'path/to/file.py:name' (the file loaded by its path,
under a module name of its own: no package, no sys.path entry needed): reward functions (reward.function), the
environments of a run (environment.factory). Light: no torch, so an environment worker process imports it alone;
models/reward.py adds the run's stored copies of reward files on top.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path


def is_file_spec(spec: str) -> bool:
    """Whether a spec names a file ('path/to/rewards.py:fn') rather than a module."""
    return spec.rpartition(":")[0].endswith(".py")


def spec_file(spec: str) -> Path:
    """The file a file spec names, as an absolute, normalised path (against this process's working directory)."""
    return Path(os.path.abspath(os.path.expanduser(spec.rpartition(":")[0])))


def absolute_spec(spec: str) -> str:
    """A file spec with its path made absolute (against this process's working directory); a module spec as it is."""
    if not is_file_spec(spec):
        return spec
    return f"{spec_file(spec)}:{spec.rpartition(':')[2]}"


def import_object(spec: str, field: str, what: str = "function", kind: str = "reward", path: Path | None = None,
                  module_name: str | None = None, sha256: str | None = None):
    """The object a spec names: 'package.module:name' imported; 'path/to/file.py:name' loaded from `path` (default:
    the file the spec names) as the module `module_name` (default 'rlhf_rewards_<hash of the path>'), once per
    process, from its bytes (`run_source`: checked against `sha256` when given). Failures raise ValueError naming
    `field` (`what` the object is, from which `kind` of file)."""
    target, _, attr = spec.rpartition(":")
    if not is_file_spec(spec):
        try:
            return getattr(importlib.import_module(target), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{field}: cannot import '{spec}' ({exc}); expected 'package.module:{what}' importable "
                             f"here, or a file 'path/to/file.py:{what}'") from exc
    origin = spec_file(spec)
    path = path or origin
    if not path.is_file():
        raise ValueError(f"{field}: {kind} file '{path}' does not exist in this process (working directory "
                         f"{os.getcwd()}): it must be at this path in every process that uses it")
    name = module_name or "rlhf_rewards_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
        module = run_source(name, path, field, origin, sha256)
    if not hasattr(module, attr):
        raise ValueError(f"{field}: '{origin}' has no {what} '{attr}'")
    return getattr(module, attr)


def run_source(name: str, path: Path, field: str, origin: Path, sha256: str | None = None) -> types.ModuleType:
    """The module `name` executed from the bytes of `path` read once here, checked against `sha256` when given: no
    import loader runs, so no bytecode cache (`__pycache__/*.pyc`, which anyone who can write beside the file could
    plant) is read or written. Registered in sys.modules before it runs (dataclasses and pickling look it up)."""
    source = path.read_bytes()
    if sha256 is not None and hashlib.sha256(source).hexdigest() != sha256:
        raise ValueError(f"{field}: '{path}' does not match its sha256 {sha256[:12]}...: refused (changed since the "
                         f"run stored it)")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)  # the checked bytes
    except Exception as exc:  # any error of the user's file, named
        del sys.modules[name]
        raise ValueError(f"{field}: loading '{origin}' failed: {type(exc).__name__}: {exc}") from exc
    return module
