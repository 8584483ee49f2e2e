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
from contextlib import suppress
from typing import Any, Callable, TypeVar

from llamarl.lib.distributed import collectives
from llamarl.lib.errors import (EXIT_PEER_LOST, EXIT_STATUS_ENV, EXIT_USER_ERROR, PARENT_ENV, StageResult, UserError,
                                chain, disk_full, disk_full_error, one_line, unreadable)
from llamarl.lib.files import outputs

C = TypeVar("C")


def load_config(cls, argv):
    """The stage's config from its command line (``--config FILE`` or ``--config-json JSON``),
    checked; a ``UserError`` in one line where it is not a valid one."""
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

        from llamarl.lib.files import yamlfile

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


def execute(cls: type[C], run: Callable[[C], Any], argv: list[str] | None = None) -> StageResult:
    """Load the stage's config from ``argv`` and run it in this process (one rank); its result: a
    user error (printed by rank 0 as ``error: …``), a write to a full file system (one line naming
    the path, as a user error), a lost peer (printed by every rank that saw it), or success. Bugs
    keep their traceback. The process group is gone afterwards, either way. The one path into a
    stage: ``main`` for processes, ``cluster.slurm``'s tasks."""
    global _output
    _marks.clear()
    mark("imported")
    _output = None
    try:
        config = load_config(cls, argv)
        mark("config")
        run(config)
    except Exception as e:
        if (full := _disk_full(e)) is not None:
            # Not alike on every rank: the rank whose write failed reports it; so does rank 0 when
            # the ranks agreed on it (as a UserError, or a RuntimeError every rank raises: the
            # same line, which the local executor shows once).
            if os.environ.get("RANK", "0") == "0" or not isinstance(e, UserError):
                print(f"error: {one_line(full)}", file=sys.stderr, flush=True)
            return StageResult(EXIT_USER_ERROR, full)
        if isinstance(e, UserError):
            # Errors reach every rank alike (config checks run everywhere; later ones go through
            # `check`), so rank 0 alone reports.
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
            return StageResult(EXIT_USER_ERROR, str(e))
        if not _lost_peer(e):
            raise
        error = _peer_error(e)
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        return StageResult(EXIT_PEER_LOST, error)
    finally:
        mark("end")
        if (liveness := sys.modules.get("llamarl.lib.distributed.liveness")) is not None:  # torch.distributed's stages
            liveness.stop()
        if (parallel := sys.modules.get("llamarl.lib.distributed.parallel")) is not None:
            parallel.shutdown()  # its groups and layout too: a resident worker runs another stage next
        collectives.leave()
        _write_profile()
    return StageResult(0)


_resident = False  # ``call``'s stage runs in a resident worker


def resident() -> bool:
    """Whether this stage runs as a call in a resident worker, where what it leaves in memory can
    serve the next stage; a stage process's memory ends with it."""
    return _resident


def call(cls: type[C], run: Callable[[C], Any], argv: list[str] | None = None, *, started: float | None = None) -> int:
    """One stage in this process: ``execute``, with the stack sampler where asked for and the
    failure written to the launcher's exit-status file (``EXIT_STATUS_ENV``); the exit status a
    stage process would have: 0, ``EXIT_USER_ERROR`` or ``EXIT_PEER_LOST``. Bugs keep their
    traceback. ``started``: the stage runs as a call in a resident worker (cluster/worker.py),
    begun then. The one path of both a stage process (``main``) and a resident worker."""
    from llamarl.lib.runtime.stack_sampler import from_env

    global _resident
    if not isinstance(sys.stdout, _UnreadStdout):
        sys.stdout = _UnreadStdout(sys.stdout)
    _resident = started is not None
    outputs.start_stage(started)
    sampler = from_env()  # LLAMARL_STACKS_DIR: every thread's stacks, sampled (lib/runtime/stack_sampler.py)
    try:
        result = execute(cls, run, argv)
    finally:
        if sampler is not None:
            sampler.stop()
    if not result.ok and os.environ.get(EXIT_STATUS_ENV):
        with suppress(OSError), open(os.environ[EXIT_STATUS_ENV], "a") as f:  # unwritable: the launcher sees 1
            f.write(f"{result.code} {' '.join(result.error.split())}\n")
    return result.code


class _UnreadStdout:
    """A stage's stdout, which it shares with the driver (``llamarl run | head``, a pager quit): once
    nothing reads it, what the stage says there (progress, its summary) is dropped, rather than
    failing the stage on a ``BrokenPipeError``; its errors go to stderr, which the driver reads."""

    def __init__(self, out):
        self._out, self._unread = out, False

    def write(self, text: str) -> int:
        self._try(self._out.write, text)
        return len(text)

    def flush(self) -> None:
        self._try(self._out.flush)

    def _try(self, do, *args) -> None:
        if self._unread:
            return
        try:
            do(*args)
        except BrokenPipeError:
            self._unread = True
            with suppress(OSError):  # what else writes to the descriptor (a library's C code) goes nowhere too
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self._out.fileno())
                os.close(null)

    def __getattr__(self, name: str):
        return getattr(self._out, name)


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
    from llamarl.lib.distributed import liveness

    text = " ".join(str(e).split())
    text = re.sub(r"^\[[^\]]*\] ", "", text)  # gloo prefixes its source file and line
    text = text.split(" This is typically caused")[0][:200]  # and may add advice meant for its own bug tracker
    me = f"rank {os.environ.get('RANK', '0')} on {socket.gethostname()}"
    master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if not collectives.joined() or "waiting for clients" in text or "client socket has timed out" in text:
        return (f"{me}: the stage's processes did not all join the rendezvous at {master} within "
                f"collective_timeout_s ({text}); check that every node started and can reach {master}")
    lost = liveness.lost_ranks()
    who = f"lost {lost}" if lost else "lost a peer"
    return (f"{me}: {who} ({text}); the stage stopped, nothing unfinished is published: rerun it to resume")


def freeze_heap() -> None:
    """Collect, then keep what is left out of the collector's sight (``gc.freeze``): for what a
    warm-up made that lives as long as the process (compiled graphs, kernels' caches). A full
    collection walks every tracked object; after torch.compile's warm-up that stalls the host
    tens of ms, which a GPU waiting on the next kernel launch spends idle (ppo's update on an
    H100: ragged micro-batches 0.35-0.39 s a step with the collector as it is, 0.33 s without)."""
    import gc

    gc.collect()
    gc.freeze()


def main(cls: type[C], run: Callable[[C], Any], argv: list[str] | None = None) -> None:
    """A stage process's ``__main__``: ``call``, then its exit status (``EXIT_USER_ERROR``,
    ``EXIT_PEER_LOST``, or 0)."""
    import gc
    import threading

    die_with_parent()
    # What the imports made lives as long as the process. Frozen out of the collector's sight, a
    # full collection during the work (a late import on a thread makes some) walks only what the
    # stage makes: unfrozen, a shard's rank 0 stalled every thread 0.25 s on one.
    gc.freeze()
    gc.enable()  # off while shard's and export's imports ran: each collection then walked them all
    code = call(cls, run, argv)
    # Leave without the interpreter's teardown: native threads (pyarrow's, torch's, gloo's) still
    # winding down have aborted it now and then ("terminate called…", status -6), which would turn
    # a reported failure into a crash; and after a success it only costs time (0.3-0.8 s a process
    # with torch loaded). Everything the stage writes is closed by now — unless a thread of its own
    # still runs (a background writer): then the interpreter waits for it, as usual.
    if code != 0 or not any(t.is_alive() and not t.daemon for t in threading.enumerate()
                            if t is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def die_with_parent() -> None:
    """A stage process (or a resident worker) the local executor started dies with the driver that
    started it (Linux's parent-death signal, which follows the driver's thread that started it): a
    driver killed outright — SIGKILL, its process group killed — leaves no rank writing on. What
    the process itself started (a rollout's tokenizer process) stays in its process group, which
    the next ``llamarl run`` stops when it takes the run's lock over."""
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
    publish = sys.modules.get("llamarl.lib.files.publish")
    parallel = sys.modules.get("llamarl.lib.distributed.parallel")  # a stage on torch.distributed
    steps = {"process_start": outputs.process_start_time(), **_marks,
             "process_group": getattr(parallel, "joined_at", None), "work_start": outputs.work_start(),
             "first_byte": getattr(publish, "first_write_time", None)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(steps, f)
