"""Only checked bytes run: a reward or environment file is executed from the bytes read (and, for a run's stored
copy, checked against its sha256) at load, never through Python's import loader, so a bytecode cache planted beside
it (`__pycache__/<name>.cpython-*.pyc`, valid for the source's mtime and size: what the loader would trust) does not
run, and none is written."""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import struct

import pytest

from models.specs import import_object

pytestmark = pytest.mark.fast


def plant_pyc(source_path, evil: str) -> str:
    """A bytecode cache of `evil` where the import system looks for `source_path`'s, stamped with the real source's
    mtime and size (so SourceFileLoader would take it for the source's)."""
    stat = os.stat(source_path)
    cache = importlib.util.cache_from_source(str(source_path))
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    code = compile(evil, str(source_path), "exec")
    header = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(stat.st_mtime) & 0xFFFFFFFF,
                                                       stat.st_size & 0xFFFFFFFF)
    with open(cache, "wb") as out:
        out.write(header + marshal.dumps(code))
    return cache


def test_a_planted_bytecode_cache_does_not_run_and_none_is_written(tmp_path):
    source = tmp_path / "rewards.py"
    source.write_text("def score(prompts, completions):\n    return [1.0 for _ in completions]\n")
    cache = plant_pyc(source, "def score(prompts, completions):\n    return [-99.0 for _ in completions]\n")
    spec = importlib.util.spec_from_file_location("probe_loader", source)  # what the import loader would run
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.score([""], ["x"]) == [-99.0]  # the loader trusts the planted cache: the attack this guards against
    fn = import_object(f"{source}:score", "reward.function", module_name="checked_bytes_probe")
    assert fn([""], ["x"]) == [1.0]  # the source's own bytes ran
    os.remove(cache)
    import_object(f"{source}:score", "reward.function", module_name="checked_bytes_probe_2")
    assert not os.path.exists(cache)  # and no cache was written


def test_bytes_that_do_not_match_the_stored_digest_are_refused(tmp_path):
    source = tmp_path / "rewards.py"
    source.write_text("def score(prompts, completions):\n    return [0.0 for _ in completions]\n")
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    assert import_object(f"{source}:score", "reward.function", module_name="digest_ok",
                         sha256=good)([""], ["a"]) == [0.0]
    with pytest.raises(ValueError, match="reward.function: .* does not match its sha256"):
        import_object(f"{source}:score", "reward.function", module_name="digest_bad", sha256="0" * 64)
