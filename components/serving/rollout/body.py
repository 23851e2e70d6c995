"""The `http` weight transfer's body (POST /update_weights): a safetensors file read as it arrives. Its header is
checked first, then each tensor is read into a buffer of its own and loaded at once: the body is never held whole.
An upload that stops sending (a dropped connection, a stalled client) ends its reader: on disconnect at once, on
silence after --body-timeout-s.

Runs in .venv-vllm: imports nothing from the project (components/serving/rollout/__init__.py).
"""

from __future__ import annotations

import json
import queue
from typing import Optional

import torch
from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def safetensors_header(body: "BodyReader") -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor of a safetensors file, in the order of their data; 400 naming what is
    wrong with a file that is not one, or not laid out back to back."""
    try:
        size = int.from_bytes(body.read(8), "little")
        if not 0 < size < min(1 << 26, body.length - 7):
            raise ValueError(f"a header of {size} bytes in a body of {body.length}")
        header = json.loads(body.read(size))
        entries = sorted((e["data_offsets"], name, SAFETENSORS_DTYPES[e["dtype"]], list(e["shape"]))
                         for name, e in header.items() if name != "__metadata__")
        at = 0
        for (begin, end), name, dtype, shape in entries:
            if begin != at or end - begin != torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size():
                raise ValueError(f"{name}: data at [{begin}, {end}) does not follow at {at} with its size")
            at = end
        return [(name, dtype, shape) for _, name, dtype, shape in entries]
    except HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
        raise HTTPException(400, f"body: not a safetensors file ({type(exc).__name__}: {exc})") from None


class BodyReader:
    """Blocking reads of a request body that the event loop feeds in chunks (a bounded queue: the body is never held
    whole). `close()` from the reading side makes the feeding side drop the rest; `abort()` from the feeding side
    (the client went away) ends the reader at once; a body that stops arriving for `timeout_s` ends it too."""

    def __init__(self, length: int, depth: int = 64, timeout_s: float = 60.0):
        self.length, self.left, self.timeout_s = length, length, timeout_s
        self.chunks: queue.Queue = queue.Queue(depth)
        self.pending, self.closed = memoryview(b""), False
        self.aborted: Optional[str] = None

    # -- the event loop's side
    async def feed(self, chunk: Optional[bytes]) -> None:
        """Queue a chunk (None: the end); when the queue is full, wait for the reader off the event loop."""
        try:
            self.chunks.put_nowait(chunk)
        except queue.Full:
            await run_in_threadpool(self._put, chunk)

    def _put(self, chunk: Optional[bytes]) -> None:
        while not self.closed:
            try:
                self.chunks.put(chunk, timeout=0.1)
                return
            except queue.Full:
                continue

    def abort(self, why: str) -> None:
        """The body will not arrive whole: the reader stops at its next read (a reader waiting on an empty queue is
        woken by the None put here; one with chunks queued sees `aborted` before it takes the next)."""
        self.aborted = why
        try:
            self.chunks.put_nowait(None)
        except queue.Full:
            pass  # chunks are queued: the reader checks `aborted` before taking each

    # -- the reading side
    def read_into(self, out) -> None:
        view, at = memoryview(out).cast("B"), 0
        while at < len(view):
            if not self.pending:
                if self.aborted:
                    raise HTTPException(400, f"body: {self.aborted} after {self.length - self.left} of its "
                                             f"content-length {self.length} bytes")
                try:
                    chunk = self.chunks.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise HTTPException(408, f"body: no data for {self.timeout_s:.0f}s after {self.length - self.left} "
                                             f"of its content-length {self.length} bytes") from None
                if chunk is None:
                    raise HTTPException(400, f"body: {self.aborted or 'ended'} after {self.length - self.left} of "
                                             f"its content-length {self.length} bytes")
                self.pending = memoryview(chunk)
            n = min(len(view) - at, len(self.pending))
            view[at:at + n] = self.pending[:n]
            self.pending, at = self.pending[n:], at + n
            self.left -= n

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(out)
        return bytes(out)

    def read_end(self) -> None:
        """The body must end where the file does."""
        if self.left or self.pending:
            raise HTTPException(400, f"body: {self.left} bytes after the safetensors file")

    def close(self) -> None:
        self.closed = True

