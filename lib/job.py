"""The entry point of a stage process (one per rank under torchrun): config in, errors out.

``python -m llamarl.stages.NAME --config CONFIG.json`` (or ``--config-json '{...}'``) validates the
stage's config (a model of ``llamarl.stages.config``) and runs it. A ``UserError`` on any rank
becomes one line on stderr (from the lowest failing rank) and exit status 2 (``EXIT_USER_ERROR``);
ranks agree on it before they exit, so nobody is left waiting in a collective. A peer lost
mid-stage (a host gone, a rendezvous never complete) becomes one line naming the lost rank and
host (``liveness``) and exit status 3 (``EXIT_PEER_LOST``), within the stage's
``collective_timeout_s``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .errors import (EXIT_PEER_LOST, EXIT_STATUS_ENV, EXIT_USER_ERROR, PARENT_ENV, UserError, chain, disk_full,
                     disk_full_error, one_line, unreadable)

C = TypeVar("C")


def _load(cls, argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", help="a JSON or YAML file with the stage's options")
    parser.add_argument("--config-json", help="the stage's options as a JSON object")
    args = parser.parse_args(argv)
    if args.config_json:
        try:
            data = json.loads(args.config_json)
        except json.JSONDecodeError as e:
            raise UserError(f"--config-json: not valid JSON ({e})") from None
        return cls.parse(data, "--config-json")
    if args.config:
        import fsspec

        from . import yamlfile

        try:
            with fsspec.open(args.config, "r") as f:
                data = yamlfile.load(f, args.config) or {}
        except FileNotFoundError:
            raise UserError(f"{args.config}: no such config file; check the --config path") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{args.config}: cannot be read as a config file ({unreadable(e)}); check the --config "
                            "path") from None
        return cls.parse(data, args.config)
    parser.error("give --config or --config-json")


# ---- the stage's processes: torch.distributed's group (lib/parallel.py) ---------------------------


def _dist():
    """torch.distributed when this process is in its process group, else None (without importing
    torch: a process that never imported it is in no such group)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank_world() -> tuple[int, int]:
    if (dist := _dist()) is not None:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj) -> list:
    """Collective: every rank's ``obj``, by rank. Alone (a world of one) no collective runs: on
    NCCL the first one would build a communicator, most of a second."""
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj=None):
    """Collective: rank 0's ``obj`` on every rank."""
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier() -> None:
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        dist.barrier()


def _leave() -> None:
    if (dist := _dist()) is not None:
        dist.destroy_process_group()


def agree(error: str | None) -> str | None:
    """Collective: the first error any rank hit (by rank), or None if none did."""
    if rank_world()[1] == 1:
        return error
    return next((e for e in all_gather_object(error) if e is not None), None)


@dataclass(frozen=True)
class Failure:
    code: int  # EXIT_USER_ERROR or EXIT_PEER_LOST
    error: str  # one line


def execute(cls: type[C], run: Callable[[C], Any], argv: list[str] | None = None) -> Failure | None:
    """Load the stage's config from ``argv`` and run it in this process (one rank); a ``Failure``
    for a user error (printed by rank 0 as ``error: …``), a write to a full file system (one line
    naming the path, as a user error) or a lost peer (printed by every rank that saw it), None
    when done. Bugs keep their traceback. The process group is gone afterwards, either way. The
    one path into a stage: ``main`` for processes, ``cluster.slurm``'s tasks."""
    global _output
    mark("imported")
    _output = None
    try:
        config = _load(cls, argv)
        mark("config")
        run(config)
    except Exception as e:
        if (full := _disk_full(e)) is not None:
            # Not alike on every rank: the rank whose write failed reports it; so does rank 0 when
            # the ranks agreed on it (as a UserError, or a RuntimeError every rank raises: the
            # same line, which the local executor shows once).
            if os.environ.get("RANK", "0") == "0" or not isinstance(e, UserError):
                print(f"error: {one_line(full)}", file=sys.stderr, flush=True)
            return Failure(EXIT_USER_ERROR, full)
        if isinstance(e, UserError):
            # Errors reach every rank alike (config checks run everywhere; later ones go through
            # `check`), so rank 0 alone reports.
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
            return Failure(EXIT_USER_ERROR, str(e))
        if not _lost_peer(e):
            raise
        error = _peer_error(e)
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        return Failure(EXIT_PEER_LOST, error)
    finally:
        mark("end")
        if (liveness := sys.modules.get(f"{__package__}.liveness")) is not None:  # torch.distributed's stages
            liveness.stop()
        _leave()
        _write_profile()
    return None


_output: str | None = None


def writes_to(url: str) -> None:
    """Say where this stage writes its output: a disk-full error names it when the failed write
    does not name a file of its own (a write to an open file says no path)."""
    global _output
    _output = url.rstrip("/")


def _disk_full(e: BaseException) -> str | None:
    """The one line of a write that failed on a full file system (``errors.disk_full``), or None."""
    words = disk_full(e)
    if words is None:
        return None
    file = next((x.filename for x in chain(e) if isinstance(x, OSError) and isinstance(x.filename, str)), None)
    if file is None or (_output is not None and _inside(file, _output)):
        file = _output  # the same line on every rank that reports it
    return disk_full_error(file or "the stage's output", words)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
               "waiting for clients", "client socket has timed out", "Connection refused")


def _lost_peer(e: BaseException) -> bool:
    """Did ``e`` come from a collective or the rendezvous losing another process (not a bug here)?"""
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", ())
    return isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_SIGNS))


def _peer_error(e: BaseException) -> str:
    from . import liveness

    text = " ".join(str(e).split())
    text = re.sub(r"^\[[^\]]*\] ", "", text)  # gloo prefixes its source file and line
    text = text.split(" This is typically caused")[0][:200]  # and may add advice meant for its own bug tracker
    me = f"rank {os.environ.get('RANK', '0')} on {socket.gethostname()}"
    master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if _dist() is None or "waiting for clients" in text or "client socket has timed out" in text:
        return (f"{me}: the stage's processes did not all join the rendezvous at {master} within "
                f"collective_timeout_s ({text}); check that every node started and can reach {master}")
    lost = liveness.lost_ranks()
    who = f"lost {lost}" if lost else "lost a peer"
    return (f"{me}: {who} ({text}); the stage stopped, nothing unfinished is published: rerun it to resume")


def main(cls: type[C], run: Callable[[C], Any], argv: list[str] | None = None) -> None:
    """A stage process's ``__main__``: ``execute``, then the failure's exit status
    (``EXIT_USER_ERROR``, ``EXIT_PEER_LOST``), or 0."""
    import threading

    from .stack_sampler import from_env

    _die_with_parent()
    sampler = from_env()  # LLAMARL_STACKS_DIR: every thread's stacks, sampled (lib/stack_sampler.py)
    failure = execute(cls, run, argv)
    if sampler is not None:
        sampler.stop()
    if failure is not None and os.environ.get(EXIT_STATUS_ENV):
        try:
            with open(os.environ[EXIT_STATUS_ENV], "a") as f:
                f.write(f"{failure.code} {' '.join(failure.error.split())}\n")
        except OSError:
            pass  # the status still reaches the launcher, as 1
    # Leave without the interpreter's teardown: native threads (pyarrow's, torch's, gloo's) still
    # winding down have aborted it now and then ("terminate called…", status -6), which would turn
    # a reported failure into a crash; and after a success it only costs time (0.3-0.8 s a process
    # with torch loaded). Everything the stage writes is closed by now — unless a thread of its own
    # still runs (a background writer): then the interpreter waits for it, as usual.
    if failure is not None or not any(t.is_alive() and not t.daemon for t in threading.enumerate()
                                      if t is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(failure.code if failure is not None else 0)


def _die_with_parent() -> None:
    """A stage process the local executor started dies with the driver that started it (Linux's
    parent-death signal): a driver killed outright — SIGKILL, its process group killed — leaves no
    rank writing on. What the process itself started (a rollout's tokenizer process) stays in its
    process group, which the next ``llamarl run`` stops when it takes the run's lock over."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the driver died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)


def check(error: str | None) -> None:
    """Raise the first error of any rank on every rank (a collective)."""
    first = agree(error)
    if first is not None:
        raise UserError(first)


_work_start: float | None = None

# Start-up profile: when this process reached each step, in Unix seconds. ``LLAMARL_PROFILE_DIR``
# set (bench/startup.py sets it), each rank writes its steps there as rank-<RANK>.json at the end.
PROFILE_ENV = "LLAMARL_PROFILE_DIR"
_marks: dict[str, float] = {}


def mark(step: str) -> None:
    """Record when this process first reached ``step`` (for the start-up profile)."""
    _marks.setdefault(step, time.time())


def _write_profile() -> None:
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return
    publish = sys.modules.get("llamarl.lib.publish")
    steps = {"process_start": process_start_time(), **_marks, "work_start": _work_start,
             "first_byte": getattr(publish, "first_write_time", None)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(steps, f)


def process_start_time() -> float | None:
    """When this process started, in Unix seconds (10 ms resolution), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


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
    from concurrent.futures import Future
    from threading import Thread

    from . import publish

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
    from . import publish

    rank, world = rank_world()
    known = {n: e for n in names if (e := publish.written_entry(f"{root}/{n}")) is not None}
    if world > 1:
        known = {k: v for p in all_gather_object(known) for k, v in p.items()}
    rest = [n for n in names if n not in known]
    if not rest:
        return {n: known[n] for n in names}
    mine = publish.file_entries(root, rest[rank::world])
    if world > 1:
        mine = {k: v for p in all_gather_object(mine) for k, v in p.items()}
    return {n: known.get(n) or mine[n] for n in names}


def prepare_output(out: str, is_current, request: dict | None = None) -> str:
    """Collective ``publish.prepare``: rank 0 decides ("skip", "resume" or "fresh"), every rank
    gets the decision, or the same error. Marks the start of the stage's work (``timing``)."""
    from . import publish

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
