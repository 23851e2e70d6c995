"""What ranks send each other besides tensors in collectives: JSON and raw tensor bytes, never a pickle.

torch.distributed's object collectives (`broadcast_object_list`, `all_gather_object`, ...) pickle on one rank and
unpickle on the others: whoever takes part in a group can make its peers run code. The ranks' messages (the run's
config, rank 0's commands, rows of rollouts, metrics, a checkpoint's plain state) are instead encoded here as one
uint8 tensor:

    8 bytes, little-endian: n, the length of the header
    n bytes: the header, JSON: {"tree": <the object>, "tensors": [[dtype, shape], ...]}
    the tensors' bytes, one after the other, in the order of "tensors"

In the tree, JSON's own values stand for themselves (None, bool, int, float, str and lists; a numpy scalar travels
as its Python number); a tuple is
{"tuple": [...]}, a dict {"dict": [[key, value], ...]} (keys: str or int), a tensor {"tensor": i}, and one of the
few dataclasses rank 0's commands carry (`DATACLASSES`) {"dataclass": name, "fields": {...}}. Anything else is
refused on the sending rank, naming where in the object it sits; a payload that does not decode is refused on the
receiving rank, naming the sender and what is wrong. Decoding builds nothing but those types.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch
from torch import Tensor

from models.data import Batch

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
HEADER_BYTES = 8
DATACLASSES = {cls.__name__: cls for cls in (Batch,)}  # what travels as its fields: a step's prompts


class PayloadError(ValueError):
    """A message between ranks that cannot be encoded (the sender) or decoded (the receiver); the message says where."""


def encode(obj) -> Tensor:
    """`obj` as one uint8 tensor (on CPU); PayloadError naming the path of a value that cannot travel."""
    tensors: list[Tensor] = []

    def node(value, path: str):
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":  # a numpy scalar: as the Python number
            return node(value.item(), path)
        if isinstance(value, int):  # an int subclass (IntEnum) travels as the int it is
            return int(value)
        if isinstance(value, float):  # numpy.float64 too
            return float(value)
        if isinstance(value, list):
            return [node(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if type(value) in (tuple, torch.Size):  # a shape travels as the tuple it is
            return {"tuple": [node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if type(value) is dict:
            items = []
            for key, v in value.items():
                if type(key) not in (str, int):
                    raise PayloadError(f"{path}: a key of type {type(key).__name__} ({key!r}); keys are str or int")
                items.append([key, node(v, f"{path}[{key!r}]")])
            return {"dict": items}
        if type(value) in DATACLASSES.values():
            return {"dataclass": type(value).__name__,
                    "fields": {f.name: node(getattr(value, f.name), f"{path}.{f.name}")
                               for f in dataclasses.fields(value)}}
        if isinstance(value, Tensor):
            if type(value) not in (Tensor, torch.nn.Parameter) or value.layout != torch.strided:
                raise PayloadError(f"{path}: a {type(value).__name__} ({value.layout}); plain dense tensors travel")
            if value.dtype not in DTYPES.values():
                raise PayloadError(f"{path}: dtype {value.dtype}; tensors of {sorted(DTYPES)} travel")
            tensors.append(value.detach().cpu().contiguous())
            return {"tensor": len(tensors) - 1}
        raise PayloadError(f"{path}: a {type(value).__module__}.{type(value).__qualname__}; what travels between "
                           f"ranks is None, bool, int, float, str, list, tuple, dict and tensors")

    tree = node(obj, "$")
    header = json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                    for t in tensors]}, separators=(",", ":")).encode()
    # the bytes are copied with numpy (a memcpy each): torch's copies of large uint8 tensors run in its thread pool,
    # which on a busy 2-core host took 50 ms for a 2 MB message of rollout rows (numpy: 1.2 ms; torch.save: 2.4 ms)
    parts = [np.frombuffer(len(header).to_bytes(HEADER_BYTES, "little") + header, dtype=np.uint8)]
    parts += [t.reshape(-1).view(torch.uint8).numpy() for t in tensors if t.numel()]
    return torch.from_numpy(np.concatenate(parts))


def decode(payload: Tensor, sender: str):
    """The object `payload` (a uint8 tensor made by `encode`) holds; PayloadError naming `sender` (e.g. 'rank 1')
    and what is wrong when it is not such a payload."""
    def fail(why: str):
        return PayloadError(f"a message from {sender} is malformed: {why}")

    if payload.dtype != torch.uint8:
        raise fail(f"dtype {payload.dtype}, expected torch.uint8")
    data = payload.detach().cpu().reshape(-1).numpy()
    if len(data) < HEADER_BYTES:
        raise fail(f"{len(data)} bytes, shorter than its header's length field")
    n = int.from_bytes(data[:HEADER_BYTES].tobytes(), "little")
    if n > len(data) - HEADER_BYTES:
        raise fail(f"a header of {n} bytes in a message of {len(data)}")
    try:
        header = json.loads(data[HEADER_BYTES:HEADER_BYTES + n].tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise fail(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict) or set(header) != {"tree", "tensors"} or not isinstance(header["tensors"], list):
        raise fail("its header is not {tree, tensors}")
    tensors, offset = [], HEADER_BYTES + n
    for i, spec in enumerate(header["tensors"]):
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], list)
                and all(type(d) is int and d >= 0 for d in spec[1])):
            raise fail(f"tensors[{i}]: {spec!r} is not [dtype, shape] with a dtype of {sorted(DTYPES)}")
        dtype, shape = DTYPES[spec[0]], spec[1]
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if offset + size > len(data):
            raise fail(f"tensors[{i}]: {spec[0]} {shape} needs {size} bytes, {len(data) - offset} are left")
        tensors.append(torch.from_numpy(data[offset:offset + size].copy()).view(dtype).reshape(shape) if size
                       else torch.empty(shape, dtype=dtype))
        offset += size
    if offset != len(data):
        raise fail(f"{len(data) - offset} bytes after its last tensor")

    def build(node, path: str):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [build(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, dict) and len(node) == 1:
            (kind, body), = node.items()
            if kind == "tuple" and isinstance(body, list):
                return tuple(build(v, f"{path}[{i}]") for i, v in enumerate(body))
            if kind == "dict" and isinstance(body, list):
                out = {}
                for item in body:
                    if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                        raise fail(f"{path}: a dict item {item!r} is not [str or int key, value]")
                    out[item[0]] = build(item[1], f"{path}[{item[0]!r}]")
                return out
            if kind == "tensor" and type(body) is int and 0 <= body < len(tensors):
                return tensors[body]
        if isinstance(node, dict) and set(node) == {"dataclass", "fields"} and node["dataclass"] in DATACLASSES:
            cls = DATACLASSES[node["dataclass"]]
            names = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(node["fields"], dict) or set(node["fields"]) != names:
                raise fail(f"{path}: a {cls.__name__} needs the fields {sorted(names)}")
            return cls(**{k: build(v, f"{path}.{k}") for k, v in node["fields"].items()})
        raise fail(f"{path}: {json.dumps(node)[:200]} is not a value, list, tuple, dict or tensor reference")

    return build(header["tree"], "$")
