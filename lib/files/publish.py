"""Publishing a stage's output directory: a marker first, the manifest last.

An output directory at any fsspec URL is *published* once ``llamarl.json`` (the manifest: what was
made, from what, and the size and checksum of every file) exists. Writers put ``.llamarl-incomplete``
in it first, so a directory left by a killed run is recognisably ours and can be cleared; a
directory holding anything else is never touched. Readers insist on the manifest and check file
sizes (cheap) and, where asked, checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator

import fsspec

from llamarl.lib.errors import UserError, disk_full
from llamarl.lib.files.checksums import ALGORITHMS, CHECKSUM, TREE, checksum, hasher, is_local  # noqa: F401 (TREE: for callers)

MANIFEST = "llamarl.json"
INCOMPLETE = ".llamarl-incomplete"
RETIRED = ".llamarl-retired"
TRASH_ENV = "LLAMARL_TRASH"
"""A folder whose files are being deleted (``retire``'s ``trash``): a stage's free-space check
waits for them when it needs their room."""
FORMAT_VERSION = 1
THREADS = 8  # files hashed or checked at once


class PublishError(UserError, RuntimeError):
    """An output that cannot be published or read; the message names the path and the fix."""


def _fs(url: str):
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def filesystem(url: str):
    """``fsspec.core.url_to_fs(url)`` for a URL the user gave: a protocol fsspec does not know, or
    one whose package is not installed (``s3://`` without s3fs), is a one-line error naming it."""
    try:
        return fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise UserError(f"{url}: cannot be opened ({e}); give a local path or a URL of an installed fsspec "
                        "file system") from None


# ---- hashing while writing -----------------------------------------------------------------------
# Every file a writer of this process writes through ``open_write`` (the DCP and safetensors
# writers among them) is hashed as its bytes go out, and its entry is kept here; ``file_entry``
# returns it for as long as the file still has the size and modification time it had when closed,
# instead of reading the file a second time.

first_write_time: float | None = None  # when this process first wrote data through a HashingWriter
_written: dict[str, tuple[dict[str, Any], Any]] = {}  # file key → (entry, mtime at close)
_written_lock = threading.Lock()


def _key(fs, path: str) -> str:
    return fs.unstrip_protocol(fs._strip_protocol(path))


def _mtime(fs, path: str):
    info = fs.info(path)
    return info.get("mtime", info.get("LastModified", info.get("created"))), info["size"]


class HashingWriter:
    """A binary stream that writes through to ``raw`` and hashes every byte on the way (sequential
    writes only: it cannot seek)."""

    def __init__(self, raw):
        self.raw, self.bytes = raw, 0
        self._hash = hasher(CHECKSUM)

    def write(self, data) -> int:
        global first_write_time
        if first_write_time is None:
            first_write_time = time.time()
        view = memoryview(data).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self._hash.update(view[:n])
        self.bytes += n
        return n

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        self.raw.flush()

    def entry(self) -> dict[str, Any]:
        return {"bytes": self.bytes, CHECKSUM: self._hash.hexdigest()}


def _keep(fs, path: str, entry: dict[str, Any]) -> None:
    """Keep the entry of the finished (closed) file at ``path`` while it has the size it says."""
    mtime, size = _mtime(fs, path)
    if size == entry["bytes"]:
        with _written_lock:
            _written[_key(fs, path)] = (entry, mtime)


def moved(fs, path: str, new_path: str) -> None:
    """``path`` was renamed to ``new_path``: its kept entry follows it."""
    with _written_lock:
        kept = _written.pop(_key(fs, path), None)
    if kept is not None:
        _keep(fs, new_path, kept[0])


def written_entry(url: str) -> dict[str, Any] | None:
    """The entry this process hashed while writing ``url``, if the file is still as it was closed."""
    fs, path = _fs(url)
    kept = _written.get(_key(fs, path))
    if kept is None:
        return None
    try:
        mtime, size = _mtime(fs, path)
    except FileNotFoundError:
        return None
    return dict(kept[0]) if (mtime, size) == (kept[1], kept[0]["bytes"]) else None


@contextmanager
def open_write(url: str) -> Iterator[HashingWriter]:
    """Open a file for writing at any fsspec URL (its folder created), hashed as it is written; its
    entry is kept for ``file_entry``. A failed write removes the file."""
    fs, path = _fs(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        with fs.open(path, "wb") as raw:
            writer = HashingWriter(raw)
            yield writer
    except BaseException:
        if fs.exists(path):
            fs.rm(path)
        raise
    _keep(fs, path, writer.entry())


def file_entry(url: str, algorithm: str = CHECKSUM) -> dict[str, Any]:
    """``{"bytes": size, algorithm: digest}`` of a file for a manifest: hashed while it was written
    when this process wrote it (``open_write``), read and hashed otherwise (``TREE``: by several
    threads)."""
    known = written_entry(url)
    if known is not None:
        return known
    fs, path = _fs(url)
    return {"bytes": fs.size(path), algorithm: checksum(url, algorithm)}


def write_bytes(url: str, data: bytes) -> dict[str, Any]:
    """Write a whole file at any fsspec URL, creating its folder (local filesystems need it);
    returns its manifest entry."""
    with open_write(url) as f:
        f.write(data)
    return f.entry()


def replace(url: str, data: bytes) -> None:
    """``data`` as the whole file at ``url`` (its folder created), in place of what was there,
    whole or not at all: written under a name of its own beside it, then renamed. On a file system
    too full for that name (no space, no inodes), a local file that already holds as many bytes is
    overwritten where it lies: its own blocks, so no write can fail half-way. Any other failure
    leaves the file as it was, and raises."""
    fs, path = _fs(url)
    folder, _, name = path.rpartition("/")
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
    fs.makedirs(folder, exist_ok=True)
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException as e:
        with suppress(OSError):
            if fs.exists(tmp):
                fs.rm(tmp)
        if disk_full(e) and is_local(fs) and os.path.exists(path) and os.stat(path).st_blocks * 512 >= len(data):
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()
            return
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, url) from e  # the file's name, not its temporary one's
        raise


def read_manifest(root: str) -> dict | None:
    """The manifest of a published directory, or None if it is not (yet) published."""
    fs, path = _fs(root)
    target = f"{path}/{MANIFEST}"
    if not fs.exists(target):
        return None
    try:
        with fs.open(target, "r") as f:
            return json.load(f)
    except json.JSONDecodeError:
        raise PublishError(f"{root}/{MANIFEST} is not valid JSON; the output is damaged: delete {root} and rerun") from None


def require_published(root: str, kind: str | None = None) -> dict:
    """The manifest of ``root``, or a clear error if ``root`` is not a finished llamarl output (or
    one whose files were deleted: ``retire``)."""
    manifest = read_manifest(root)
    if manifest is not None and (gone := retired(root)) is not None:
        if gone.get("unwritten"):
            raise PublishError(f"{root} was not written ({gone.get('why')}); rerun `llamarl run`, which makes it "
                               "again from the newest one written")
        raise PublishError(f"{root} was deleted by its run's retention ({gone.get('why')}); rerun `llamarl run`, which "
                           "makes again what a stage that runs needs, or keep more (retention in the run spec)")
    if manifest is None:
        fs, path = _fs(root)
        if not fs.exists(path):
            raise PublishError(f"{root} does not exist; check the path")
        if fs.exists(f"{path}/{INCOMPLETE}"):
            raise PublishError(f"{root} is an unfinished output (its run was interrupted); rerun the stage that writes it")
        raise PublishError(f"{root} is not a llamarl output (no {MANIFEST}); point at a published directory")
    if kind is not None and manifest.get("kind") != kind:
        raise PublishError(f"{root} holds a {manifest.get('kind')!r}, not a {kind!r}; point at a {kind} directory")
    return manifest


def prepare(root: str, is_current: Callable[[dict], bool], request: dict | None = None) -> str:
    """Get ``root`` ready for writing; returns what to do:

    * ``"skip"``: it already holds a published output that ``is_current`` accepts;
    * ``"resume"``: it holds our unfinished output of the same ``request`` (recorded in the
      marker): keep the parts already published inside it;
    * ``"fresh"``: start from an empty directory (our unfinished output of another request is
      cleared).

    Refuses to touch a different published output or a directory that is not ours."""
    fs, path = _fs(root)
    manifest = read_manifest(root)
    if manifest is not None:
        if is_current(manifest):
            return "skip"
        raise PublishError(
            f"{root} already holds a different published output ({manifest.get('kind')}, made "
            f"{manifest.get('created')}); choose another destination or delete it"
        )
    marker = f"{path}/{INCOMPLETE}"
    wanted = json.dumps(request, sort_keys=True) if request is not None else None
    if fs.exists(path) and fs.ls(path, detail=False):
        if not fs.exists(marker):
            raise PublishError(f"{root} exists and is not a llamarl output; refusing to overwrite it — choose an empty destination")
        if wanted is not None and fs.cat_file(marker).decode() == wanted:
            return "resume"
        for entry in fs.ls(path, detail=False):
            if entry.rstrip("/").rsplit("/", 1)[-1] != INCOMPLETE:
                fs.rm(entry, recursive=True)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(marker, (wanted or "").encode())
    return "fresh"


def discard(root: str) -> None:
    """Remove our unfinished output at ``root`` (its marker there, no manifest): what a stage that
    failed on bad input made of it. Anything else is left as it is."""
    fs, path = _fs(root)
    if fs.exists(f"{path}/{INCOMPLETE}") and not fs.exists(f"{path}/{MANIFEST}"):
        fs.rm(path, recursive=True)


def retire(root: str, why: str, keep: tuple[str, ...] = (), trash: str | None = None) -> bool:
    """Delete the files of the published output ``root`` but its manifest (and ``keep``), marked
    first: its id stays (what was made from it keeps its key), and no reader takes it for whole.
    ``trash``: a folder on the same file system to move them into instead, at once (deleting GBs
    takes seconds), for the caller to empty. True when it was whole before (False: not published,
    or retired already)."""
    fs, path = _fs(root)
    if read_manifest(root) is None:
        return False
    fresh = retired(root) is None
    if fresh:
        fs.pipe_file(f"{path}/{RETIRED}", json.dumps({"why": why, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime())}).encode())
    for entry in fs.ls(path, detail=False):  # also what a retire cut short left
        if entry.rstrip("/").rsplit("/", 1)[-1] not in (MANIFEST, RETIRED, *keep):
            if trash is None:
                fs.rm(entry, recursive=True)
            else:
                fs.makedirs(trash, exist_ok=True)
                fs.mv(entry, f"{trash.rstrip('/')}/{uuid.uuid4().hex}", recursive=True)
    return fresh


def publish_unwritten(root: str, manifest: dict, why: str) -> None:
    """Publish ``manifest`` (with no files) as an output whose files were never written — retired
    at birth (``retire``): marked first, so that no reader ever takes it for whole. What needs it
    is made again as a retired output's readers are (pipeline/records.py ``plan``)."""
    fs, path = _fs(root)
    fs.pipe_file(f"{path}/{RETIRED}", json.dumps({"why": why, "unwritten": True}).encode())
    publish(root, {**manifest, "files": {}})


def unwritten(root: str) -> bool:
    """Whether ``root`` was published with its files never written (``publish_unwritten``)."""
    return bool((retired(root) or {}).get("unwritten"))


def retired(root: str) -> dict | None:
    """What ``retire`` recorded of ``root`` (why, when), or None when its files are there."""
    fs, path = _fs(root)
    try:
        return json.loads(fs.cat_file(f"{path}/{RETIRED}"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {"why": "unreadable record"}


def output_id(root: str) -> str:
    """A short id of a published output: the hash of its manifest (which hashes every file)."""
    fs, path = _fs(root)
    return hashlib.sha256(fs.cat_file(f"{path}/{MANIFEST}")).hexdigest()[:16]


def publish(root: str, manifest: dict) -> None:
    """Write the manifest (the output becomes visible), then drop the marker."""
    fs, path = _fs(root)
    body = {"format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **manifest}
    tmp = f"{path}/.{MANIFEST}.tmp"
    fs.pipe_file(tmp, json.dumps(body, indent=1, sort_keys=True).encode())
    fs.mv(tmp, f"{path}/{MANIFEST}")
    if fs.exists(f"{path}/{INCOMPLETE}"):
        fs.rm(f"{path}/{INCOMPLETE}")


def verify(root: str, files: dict[str, dict], names: list[str] | None = None) -> None:
    """Check files of a published directory against its manifest entries (sizes, then checksums,
    up to ``THREADS`` files at a time); the first damaged file raises."""
    fs, path = _fs(root)
    names = names if names is not None else sorted(files)
    for name in names:
        target = f"{path}/{name}"
        if not fs.exists(target):
            raise PublishError(f"{root}/{name} is missing; the output is damaged: delete {root} and rerun the stage that wrote it")
        if fs.size(target) != files[name]["bytes"]:
            raise PublishError(f"{root}/{name} has {fs.size(target)} bytes, the manifest says {files[name]['bytes']}; "
                               f"the output is damaged: delete {root} and rerun the stage that wrote it")
    if not names:
        return

    def matches(name: str) -> tuple[str, str | None, bool]:
        entry = files[name]
        algorithm = next((a for a in ALGORITHMS if a in entry), None)
        return name, algorithm, algorithm is not None and checksum(f"{root}/{name}", algorithm) == entry[algorithm]

    with ThreadPoolExecutor(min(THREADS, len(names))) as pool:
        for name, algorithm, ok in pool.map(matches, names):
            if algorithm is None:
                raise PublishError(f"{root}/{name}: its manifest entry names no checksum this version knows "
                                   f"({', '.join(ALGORITHMS)}); read it with the llamarl version that wrote it, "
                                   f"or rerun the stage that wrote it")
            if not ok:
                raise PublishError(f"{root}/{name} does not match its {algorithm} checksum in the manifest; "
                                   f"the output is corrupt: delete {root} and rerun the stage that wrote it")


def share(files: dict[str, dict], names: list[str], rank: int, world: int) -> list[str]:
    """This rank's share of ``names`` to hash or verify: the largest files first, each to the rank
    with the fewest bytes so far (a checkpoint's few large files spread over the ranks)."""
    loads, mine = [0] * world, []
    for name in sorted(names, key=lambda n: (-files.get(n, {}).get("bytes", 0), n)):
        r = loads.index(min(loads))
        loads[r] += files.get(name, {}).get("bytes", 0) + 1
        if r == rank:
            mine.append(name)
    return mine


def require_verified(root: str, kind: str, prefix: str = "") -> dict:
    """``require_published``, then every file under ``prefix`` checked against the manifest (sizes
    and checksums): what a stage reads is exactly what its producer published."""
    manifest = require_published(root, kind)
    verify(root, manifest["files"], sorted(k for k in manifest["files"] if k.startswith(prefix)))
    return manifest
