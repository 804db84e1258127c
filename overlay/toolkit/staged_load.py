"""Read consecutive tensors of a file onto a device, checking each one's sha256, with bounded host RAM.

The quantized transformer cache is ~18 GB at full size. Reading it whole into host RAM and
then moving the model to the GPU made the host hold the whole model, and hashing after
reading made the load hashing-bound (26 s for a file the disk reads in 10 s). Here:

- for a GPU target, the file is read into a few fixed staging buffers (pinned where the
  platform allows, plain memory otherwise) and each buffer is copied into the tensors'
  final device memory while the next one is read; host RAM is the staging buffers;
- sha256 runs on worker threads (hashlib releases the GIL), one tensor's pieces in file
  order and different tensors in parallel, overlapping the reads;
- for a CPU target, the file is read straight into the final tensors;
- the target may differ per tensor (a memory plan's streamed blocks on the host, the rest on the
  GPU): each tensor is allocated where it goes and filled from the staging buffers.

Nothing is returned until every tensor's digest matches; on a mismatch or a short file a
StagedReadError names the tensor, and the device memory read so far is simply dropped.
"""

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from toolkit.host_memory import release_pinned_cache

STAGING_BUFFERS = 4
STAGING_BUFFER_BYTES = 64 << 20
_EMPTY_SHA256 = hashlib.sha256().hexdigest()


class StagedReadError(Exception):
    """The file does not hold what the caller described (checksum mismatch or a short read)."""


@dataclass(frozen=True)
class TensorSpan:
    """One tensor stored at [begin, end) of the file (absolute offsets)."""

    name: str
    begin: int
    end: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def default_hash_threads() -> int:
    """Enough threads to keep up with a fast disk, leaving a core to the reader."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


class _Hashes:
    """sha256 per tensor on a thread pool: pieces of one tensor in order, tensors in parallel.

    The pool's queue is FIFO, so a piece that waits for its predecessor only ever waits for a
    task that a worker has already taken: no deadlock, whatever the pool size.
    """

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sha256")
        self._hashes: Dict[str, "hashlib._Hash"] = {}
        self._last: Dict[str, Future] = {}

    def feed(self, name: str, data: memoryview) -> Future:
        digest = self._hashes.setdefault(name, hashlib.sha256())
        before = self._last.get(name)

        def update():
            if before is not None:
                before.result()
            digest.update(data)

        future = self._pool.submit(update)
        self._last[name] = future
        return future

    def hexdigest(self, name: str) -> str:
        if name in self._last:
            self._last[name].result()
        return self._hashes[name].hexdigest() if name in self._hashes else _EMPTY_SHA256

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _read_into(f: BinaryIO, view: memoryview, what: str) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise StagedReadError(f"file ends inside {what}")
        done += got


def _check_contiguous(spans: Sequence[TensorSpan]) -> None:
    for before, after in zip(spans, spans[1:]):
        if after.begin != before.end:
            raise ValueError(f"{after.name} does not follow {before.name} in the file")


class _Staging:
    """A ring of staging buffers; a buffer is reused once its copies and hashes are done."""

    def __init__(self, count: int, nbytes: int, pin: bool, log):
        first = self._allocate(nbytes, pin, log)
        self.pinned = pin and first.is_pinned()
        self.buffers = [first] + [self._allocate(nbytes, self.pinned, log) for _ in range(count - 1)]
        self._pending: List[Tuple[Optional[torch.cuda.Event], List[Future]]] = [(None, [])] * count

    def _allocate(self, nbytes: int, pin: bool, log) -> torch.Tensor:
        if pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:  # no pinned memory on this platform or driver
                log(f"pinned staging memory unavailable ({error}); using plain memory")
        return torch.empty(nbytes, dtype=torch.uint8)

    def take(self, index: int) -> torch.Tensor:
        event, futures = self._pending[index]
        if event is not None:
            event.synchronize()
        for future in futures:
            future.result()
        self._pending[index] = (None, [])
        return self.buffers[index]

    def hand_back(self, index: int, event, futures: List[Future]) -> None:
        self._pending[index] = (event, futures)

    def drain(self) -> None:
        for index in range(len(self.buffers)):
            self.take(index)


def _allocate(span: TensorSpan, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The span's final tensor, and its bytes as a flat uint8 view to read into. The tensor is no
    view itself: a module buffer that is a view reaches a compiled block as a new view object on
    every call (torch.compile rebuilds views of its inputs), so what is kept on the tensor, e.g.
    toolkit/int4_w4a8.py's weight scales, would be lost on each call."""
    tensor = torch.empty(span.shape, dtype=span.dtype, device=device)
    return tensor, tensor.reshape(-1).view(torch.uint8)


def _to_device(f, spans, devices: Dict[str, torch.device], hashes, staging: _Staging) -> Dict[str, torch.Tensor]:
    """Fill each tensor on its device from the file through the staging ring."""
    out = {span.name: _allocate(span, devices[span.name]) for span in spans}
    size = staging.buffers[0].numel()
    start, stop = spans[0].begin, spans[-1].end
    f.seek(start)
    position, slot, first = start, 0, 0
    while position < stop:
        length = min(size, stop - position)
        buffer = staging.take(slot)
        view = memoryview(buffer.numpy())[:length]
        _read_into(f, view, f"the tensors after offset {position}")
        futures = []
        while first < len(spans) and spans[first].end <= position:
            first += 1
        index = first
        while index < len(spans) and spans[index].begin < position + length:
            span = spans[index]
            lo, hi = max(span.begin, position), min(span.end, position + length)
            if hi > lo:
                piece = buffer[lo - position : hi - position]
                out[span.name][1][lo - span.begin : hi - span.begin].copy_(piece, non_blocking=staging.pinned)
                futures.append(hashes.feed(span.name, view[lo - position : hi - position]))
            index += 1
        event = None
        if staging.pinned:
            event = torch.cuda.Event()
            event.record()
        staging.hand_back(slot, event, futures)
        position += length
        slot = (slot + 1) % len(staging.buffers)
    staging.drain()
    return {name: tensor for name, (tensor, _) in out.items()}


def _to_host(f, spans, hashes) -> Dict[str, torch.Tensor]:
    """Read straight into the final CPU tensors; hashing overlaps the next reads."""
    out = {}
    f.seek(spans[0].begin)
    for span in spans:
        tensor, raw = _allocate(span, "cpu")
        if span.nbytes:
            view = memoryview(raw.numpy())
            for lo in range(0, span.nbytes, STAGING_BUFFER_BYTES):
                piece = view[lo : lo + STAGING_BUFFER_BYTES]
                _read_into(f, piece, f"tensor {span.name!r}")
                hashes.feed(span.name, piece)
        out[span.name] = tensor
    return out


def read_spans(
    f: BinaryIO,
    spans: Sequence[TensorSpan],
    device: Union[torch.device, Callable[[str], torch.device]],
    *,
    pin: bool = True,
    buffers: int = STAGING_BUFFERS,
    buffer_bytes: int = STAGING_BUFFER_BYTES,
    hash_threads: Optional[int] = None,
    log=print,
) -> Dict[str, torch.Tensor]:
    """{name: tensor on device} for consecutive spans of an open binary file, all checksums verified.
    `device` is one device for every tensor, or a function of a tensor's name giving its device.

    Raises StagedReadError on a checksum mismatch or a file that ends early.
    """
    spans = sorted(spans, key=lambda s: s.begin)
    if not spans:
        return {}
    _check_contiguous(spans)
    place = device if callable(device) else (lambda _, one=torch.device(device): one)
    devices = {span.name: torch.device(place(span.name)) for span in spans}
    hashes = _Hashes(hash_threads or default_hash_threads())
    try:
        if all(where.type == "cpu" for where in devices.values()):
            tensors = _to_host(f, spans, hashes)
        else:
            staging = _Staging(buffers, buffer_bytes, pin and torch.cuda.is_available(), log)
            tensors = _to_device(f, spans, devices, hashes, staging)
            pinned = staging.pinned
            del staging
            if pinned:
                release_pinned_cache()
        for span in spans:
            if hashes.hexdigest(span.name) != span.sha256:
                raise StagedReadError(f"{span.name}: data checksum mismatch")
    finally:
        hashes.close()
    return tensors
