"""Messages between ranks as JSON and tensor bytes (models/wire.py): what the ranks send comes back as it was, what
cannot travel is refused naming where it sits, and a payload that is not ours (a pickle above all) is refused naming
its sender, without calling anything it names."""

from __future__ import annotations

import json
import pathlib
import pickle
import re

import numpy as np
import pytest
import torch

from models.data import Batch
from models.wire import DTYPES, PayloadError, decode, encode

pytestmark = pytest.mark.fast


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def test_what_the_ranks_send_comes_back_as_it_was():
    """The run's config (a JSON string), rank 0's commands (a step's prompts: a Batch), rows of every dtype (0-dim,
    empty, non-contiguous, bfloat16), a checkpoint's plain state (int keys, tuples, RNG bytes, NaN), nested."""
    rows = {name: torch.arange(12).reshape(3, 4).to(dtype) for name, dtype in DTYPES.items()}
    message = {
        "op": "update", "config": json.dumps({"a": 1}), "args": (1, 2.5, None, True, "x", -2**70),
        "rows": rows, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 7), "strided": torch.arange(20)[::3],
        "transposed": torch.arange(6.0).reshape(2, 3).t(), 7: [{"nested": (torch.ones(2, dtype=torch.bool),)}],
        "rng": torch.ByteTensor(list(range(256))), "nan": float("nan"), "inf": float("-inf"),
        "shape": torch.Size([2, 3]), "numpy": (np.float32(0.5), np.int64(-3), np.bool_(True)),
        "prompts": Batch(["a", "b"], [{"answer": 1}, {"answer": None}], True,
                         [[{"role": "user", "content": "a"}], "b"])}
    back = decode(encode(message), "rank 1")
    assert same({**message, "shape": (2, 3), "numpy": (0.5, -3, True), "prompts": None}, {**back, "prompts": None})
    assert back["prompts"] == message["prompts"]
    assert back["strided"].is_contiguous() and back["transposed"].tolist() == message["transposed"].tolist()


@pytest.mark.parametrize("value, where", [
    ({"ok": [1, {"bad": object()}]}, r"\$\['ok'\]\[1\]\['bad'\]: a builtins.object"),
    ({(1, 2): "tuple key"}, r"\$: a key of type tuple"),
    ([torch.zeros(2, dtype=torch.complex64)], r"\$\[0\]: dtype torch.complex64"),
    ({"array": np.zeros(3)}, r"\$\['array'\]: a numpy.ndarray"),
    ({"sparse": torch.eye(2).to_sparse()}, r"\$\['sparse'\]: a Tensor \(torch.sparse_coo\)"),
    (pathlib.Path("/tmp"), r"\$: a pathlib.PosixPath"),
])
def test_what_cannot_travel_is_refused_naming_where_it_sits(value, where):
    with pytest.raises(PayloadError, match=where):
        encode(value)


class Planted:
    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_pickle_is_refused_naming_its_sender_and_nothing_it_names_is_called(tmp_path):
    planted = Planted()
    planted.marker = str(tmp_path / "ran")
    payload = torch.frombuffer(bytearray(pickle.dumps([planted])), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="a message from rank 3 is malformed"):
        decode(payload, "rank 3")
    assert not (tmp_path / "ran").exists()


def malformed() -> dict[str, torch.Tensor]:
    def message(header: dict, data: bytes = b"") -> torch.Tensor:
        raw = json.dumps(header).encode()
        return torch.frombuffer(bytearray(len(raw).to_bytes(8, "little") + raw + data), dtype=torch.uint8)

    good = encode({"t": torch.arange(4)})
    return {
        "shorter than its header's length field": torch.zeros(3, dtype=torch.uint8),
        "its header is not JSON": torch.frombuffer(bytearray((4).to_bytes(8, "little") + b"\xff{[x"),
                                                   dtype=torch.uint8),
        "needs 32 bytes, 8 are left": torch.cat([good[:-24]]),
        "8 bytes after its last tensor": torch.cat([good, torch.zeros(8, dtype=torch.uint8)]),
        "is not [dtype, shape]": message({"tree": None, "tensors": [["object", [1]]]}),
        "is not a value, list, tuple, dict or tensor reference": message({"tree": {"tensor": 5}, "tensors": []}),
        "a dict item": message({"tree": {"dict": [[[1], 2]]}, "tensors": []}),
        "its header is not {tree, tensors}": message({"tree": 1}),
        "a Batch needs the fields": message({"tree": {"dataclass": "Batch", "fields": {"prompts": []}}, "tensors": []}),
    }


@pytest.mark.parametrize("why", list(malformed()))
def test_a_malformed_message_is_refused_saying_what_is_wrong(why):
    with pytest.raises(PayloadError, match=f"a message from rank 1 is malformed: .*{re.escape(why)}"):
        decode(malformed()[why], "rank 1")
