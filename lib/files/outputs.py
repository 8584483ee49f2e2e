"""A stage's outputs and inputs across its ranks: the output directory made ready (skip, resume or
fresh) by rank 0 and agreed on, the published inputs verified with each rank a share of the
bytes, the files of an output hashed for its manifest, and the manifest's ``timing``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Thread

from llamarl.lib.distributed.collectives import all_gather_object, broadcast_object, check, rank_world
from llamarl.lib.errors import UserError

_work_start: float | None = None  # when this process's stage began its work (``prepare_output``)
_call_start: float | None = None  # when the stage's call began, in a process that runs stages as calls


def start_stage(call_start: float | None = None) -> None:
    """A stage begins in this process: the work start of the one before it is forgotten.
    ``call_start``: the stage runs as a call in a resident worker (cluster/worker.py), and its
    start stands for the process's own in ``timing`` — a stage's start-up is measured from where
    it began, not from when the worker did."""
    global _work_start, _call_start
    _work_start, _call_start = None, call_start


def process_start_time() -> float | None:
    """When this stage's process started, in Unix seconds (10 ms resolution), from /proc; None
    elsewhere. In a resident worker: when the stage's call began (``start_stage``)."""
    if _call_start is not None:
        return _call_start
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def work_start() -> float | None:
    """When this process's stage began its work (its output made ready), in Unix seconds."""
    return _work_start


def timing() -> dict:
    """For a stage's manifest: when this process started, when it began the stage's work (its
    output prepared: imports, process groups and input checks done) and now, in Unix seconds."""
    return {"process_start": process_start_time(), "work_start": _work_start, "work_end": time.time()}


def verify_input(root: str, manifest: dict, prefix: str = "") -> None:
    """Collective: the files of a published input under ``prefix`` checked against its manifest
    (sizes and checksums), each rank a share of the bytes (several files at a time); a damaged file
    fails every rank in one line."""
    check(start_verify(root, manifest, prefix).result())


def start_verify(root: str, manifest: dict, prefix: str = ""):
    """``verify_input``'s share of this rank, on a thread: a future of this rank's error (None when
    its files are whole). Not collective: the caller agrees on the result (``check``) before it
    publishes anything made from the input — a stage that reads while its input is verified."""
    from llamarl.lib.files import publish

    names = sorted(k for k in manifest["files"] if k.startswith(prefix))
    rank, world = rank_world()
    mine = publish.share(manifest["files"], names, rank, world)
    done: Future = Future()

    def run() -> None:
        try:
            publish.verify(root, manifest["files"], mine)
            done.set_result(None)
        except UserError as e:
            done.set_result(str(e))
        except BaseException as e:  # noqa: BLE001 — raised where the result is asked for
            done.set_exception(e)

    Thread(target=run, name="llamarl-verify", daemon=True).start()
    return done


def file_entries(root: str, names: list[str]) -> dict:
    """Collective: size and checksum of each ``root/name`` for a manifest, gathered on every rank.
    A file some rank wrote through ``publish.open_write`` (or ``checkpoint.save``) was hashed as it
    was written: that rank's entry is used. The rest are read and hashed, each rank a share."""
    from llamarl.lib.files import publish

    rank, world = rank_world()
    known = {n: e for n in names if (e := publish.written_entry(f"{root}/{n}")) is not None}
    known = {k: v for p in all_gather_object(known) for k, v in p.items()}  # alone: no collective
    rest = [n for n in names if n not in known]
    if not rest:
        return {n: known[n] for n in names}
    share = rest[rank::world]
    with ThreadPoolExecutor(max(1, min(publish.THREADS, len(share)))) as pool:  # several files at a time
        entries = dict(zip(share, pool.map(lambda n: publish.file_entry(f"{root}/{n}"), share)))
    mine = {k: v for p in all_gather_object(entries) for k, v in p.items()}
    return {n: known.get(n) or mine[n] for n in names}


def prepare_output(out: str, is_current, request: dict | None = None) -> str:
    """Collective ``publish.prepare``: rank 0 decides ("skip", "resume" or "fresh"), every rank
    gets the decision, or the same error. Marks the start of the stage's work (``timing``)."""
    from llamarl.lib.files import publish

    global _work_start
    _work_start = _work_start or time.time()

    decision, error = None, None
    if rank_world()[0] == 0:
        try:
            decision = publish.prepare(out, is_current, request)
        except UserError as e:
            error = str(e)
    check(error)
    return broadcast_object(decision)
