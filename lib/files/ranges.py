"""Byte ranges of files read into memory without an intermediate copy: mapped (local files), read
into a given buffer, or read through pinned buffers bound for a GPU; and read-only files over bytes
already read (what torch's zip reader is given).
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from llamarl.lib.files.checksums import is_local


class Sparse(io.RawIOBase):
    """An item of which only the first and last bytes were read (enough for its zip directory,
    its pickle and the offset of its data); reading anything else fails."""

    def __init__(self, head, tail, length: int):
        self.head, self.tail, self.length, self.pos = head, tail, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = offset + (0, self.pos, len(self))[whence]
        return self.pos

    def tell(self):
        return self.pos

    def __len__(self) -> int:
        return self.length

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        if self.pos + n <= len(self.head):
            b[:n] = self.head[self.pos : self.pos + n]
        elif self.pos >= self.length - len(self.tail):
            at = self.pos - (self.length - len(self.tail))
            b[:n] = self.tail[at : at + n]
        else:
            raise OSError("outside the bytes read")
        self.pos += n
        return n


class MemoryFile(Sparse):
    """A read-only, seekable file over a memoryview (no copy): all of it is the head."""

    def __init__(self, view: memoryview):
        super().__init__(view, b"", len(view))


HUGE_BYTES = 2 << 20  # a transparent huge page: buffers this large get pages of this size


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for bytes about to be read into it. One of ``HUGE_BYTES`` or
    more is an anonymous mapping of its own, advised for transparent huge pages (freed when the
    tensor is): torch's allocator maps such a buffer afresh and the kernel faults it in 4 KiB at a
    time, which costs more than reading the bytes into it (NumPy advises its arrays so too)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps ``buf``


class ShortRead(OSError):
    """A file ended before the bytes asked for: it changed while being read."""


def mapped(fs, path: str, begin: int, end: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Bytes ``begin:end`` of a local file as a 1-D tensor of ``dtype`` over the page cache (a
    copy-on-write mapping: a write to the tensor never reaches the file, and the mapping goes with
    the tensor); None on other file systems, or for no bytes. Nothing is copied, and no fresh
    memory is faulted in: the kernel zeroes every new page, which costs more than reading the
    bytes into it (15 % of a shard's CPU time in a VM). ``ShortRead`` where the file ends before
    ``end``; a file cut short while mapped stops the process (SIGBUS), as any mapped file does."""
    if not is_local(fs) or end <= begin:
        return None
    fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < end:
            raise ShortRead(f"{path}: ends before byte {end}; the file changed while being read")
        start = begin - begin % mmap.ALLOCATIONGRANULARITY
        buf = mmap.mmap(fd, end - start, access=mmap.ACCESS_COPY, offset=start)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin - start)


def read_into(fs, path: str, begin: int, view: memoryview) -> None:
    """Bytes ``begin:begin+len(view)`` of a file into ``view`` (local files: ``preadv``, no
    intermediate copy; others: one range request). ``ShortRead`` where the file ends before."""
    if is_local(fs):
        fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], begin + done)
                if n <= 0:
                    raise ShortRead(f"{path}: short read at byte {begin + done}; the file changed while being read")
                done += n
        finally:
            os.close(fd)
    else:
        data = fs.cat_file(path, begin, begin + len(view))
        if len(data) != len(view):
            raise ShortRead(f"{path}: short read at byte {begin}; the file changed while being read")
        view[:] = data


def read_staged(fs, pool: ThreadPoolExecutor, jobs: list[tuple], threads: int) -> None:
    """``jobs`` — ``(path, begin, bytes, into, then)``: read into the CPU tensor ``into`` or, when
    None, a staging buffer; ``then(bytes read)`` or None — read by ``pool``; each ``then`` (the
    copies out of the buffer) runs on this thread, in order, before its buffer is handed out again.

    The ``threads + 2`` staging buffers are pinned once and cycled: pinning is a system call over
    every page (slow, slower still in a VM), so a buffer pinned per block costs more than the read.
    A buffer is handed out again once the copies queued out of it have run (an event)."""
    nbytes = max([n for _, _, n, into, _ in jobs if into is None], default=1)
    free = collections.deque(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(threads + 2))
    busy: collections.deque = collections.deque()  # (event after the copies out of it, buffer)
    pending: collections.deque = collections.deque()

    def finish_oldest() -> None:
        fut, buf, n, then, staged = pending.popleft()
        fut.result()
        if then is not None:
            then(buf[:n])
        if staged:
            event = torch.cuda.Event()
            event.record()
            busy.append((event, buf))

    for path, begin, n, into, then in jobs:
        if into is None and not free:
            event, buf = busy.popleft()
            event.synchronize()
            free.append(buf)
        buf = free.popleft() if into is None else into
        pending.append((pool.submit(read_into, fs, path, begin, memoryview(buf[:n].numpy())), buf, n, then, into is None))
        if len(pending) >= threads:
            finish_oldest()
    while pending:
        finish_oldest()
