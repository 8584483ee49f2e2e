"""Checksums of output files: the algorithms a manifest may name, and a whole file's checksum
read again (writers hash as they write: ``publish.open_write``); a local file is hashed in place.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import fsspec

from llamarl.lib.errors import UserError

# The checksum this version writes: XXH3-128 runs at memory speed (≈ 8 GB/s a core here, against
# sha256's ≈ 1.3 and blake2b's ≈ 1.0), and a PPO iteration checksums tens of GB of optimizer state.
# It guards against damage, not tampering. Each file's entry names its algorithm (the key holding
# the digest); entries of older manifests with "sha256" still verify.
CHECKSUM = "xxh3_128"
# A file hashed by reading it, not while writing it (a shard stage's source): XXH3-128 of the
# XXH3-128 digests of its 64 MiB blocks, so several threads hash one file at once.
TREE = "xxh3_128_tree"
TREE_BLOCK = 64 << 20
ALGORITHMS = ("xxh3_128", TREE, "sha256")
_BLOCK = 16 << 20  # bytes read, or mapped, at a time when hashing a file


def hasher(algorithm: str = CHECKSUM):
    """A new hash object (``update``, ``hexdigest``) of one of ``ALGORITHMS``."""
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm not in ALGORITHMS or algorithm == TREE:  # TREE hashes blocks, not a stream: ``checksum``
        raise UserError(f"unknown checksum algorithm {algorithm!r} for a stream; this version knows "
                        f"{', '.join(a for a in ALGORITHMS if a != TREE)}")
    return hashlib.new(algorithm)


def is_local(fs) -> bool:
    """Whether ``fs``'s paths are paths of this machine's file system. Not fsspec's ``local_file``:
    its caching wrappers (``simplecache::``) set it too, for files that ``open`` copies locally."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _hash_in_place(h, fs, path: str, start: int, length: int) -> bool:
    """Hash bytes ``start:start+length`` of a local file over its page cache, mapped a window at a
    time (a mapped page counts in the process's memory until it is unmapped); False where the file
    is not local or ends before (its reader says so). 2.5× faster than reading: a read copies every
    byte once more. A file cut short while mapped stops the process (SIGBUS), as any mapped file does."""
    if not is_local(fs) or length <= 0:
        return False
    with open(fs._strip_protocol(path), "rb") as f:
        if os.fstat(f.fileno()).st_size < start + length:
            return False
        end = start + length
        at = start - start % mmap.ALLOCATIONGRANULARITY
        while at < end:
            n = min(_BLOCK, end - at)
            with mmap.mmap(f.fileno(), n, access=mmap.ACCESS_READ, offset=at) as m, memoryview(m) as window:
                skip = max(start - at, 0)
                with window[skip:] as part:
                    h.update(part)
            at += n
    return True


def _hash_range(h, fs, path: str, start: int, length: int, read_bytes: int, url: str) -> None:
    """Hash bytes ``start:start+length`` of a file into ``h``: in place where it is local, else read
    ``read_bytes`` at a time (what a reader holds)."""
    if _hash_in_place(h, fs, path, start, length):
        return
    buf = memoryview(bytearray(read_bytes))
    with fs.open(path, "rb") as f:
        f.seek(start)
        while length:
            n = f.readinto(buf[: min(read_bytes, length)])
            if not n:
                raise UserError(f"{url}: short read; the file changed while being hashed")
            h.update(buf[:n])
            length -= n


def checksum(url: str, algorithm: str = CHECKSUM) -> str:
    """The checksum of a whole file, read again."""
    if algorithm == TREE:
        return _tree_checksum(url)
    h = hasher(algorithm)
    fs, path = fsspec.core.url_to_fs(url)
    _hash_range(h, fs, path, 0, fs.size(path), _BLOCK, url)
    return h.hexdigest()


def _tree_checksum(url: str, threads: int = 4, read_bytes: int = 4 << 20) -> str:
    """``TREE`` of a file: its blocks hashed by ``threads`` threads, each reading ``read_bytes`` at
    a time (what it holds)."""
    import xxhash

    fs, path = fsspec.core.url_to_fs(url)
    size = fs.size(path)

    def block(start: int) -> bytes:
        h = xxhash.xxh3_128()
        _hash_range(h, fs, path, start, min(TREE_BLOCK, size - start), read_bytes, url)
        return h.digest()

    with ThreadPoolExecutor(max(1, threads)) as pool:
        digests = list(pool.map(block, range(0, size, TREE_BLOCK)))
    return xxhash.xxh3_128(b"".join(digests)).hexdigest()
