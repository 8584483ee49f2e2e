"""One ``llamarl run`` per run directory: ``RUN/pipeline/lock.json``, created exclusively (``xb``:
atomic on local and network file systems; object stores without it get last-writer-wins), with a
heartbeat every ``lease_s / 4``. It names its holder (user, host, pid and the pid's start time, pid
namespace) and the processes of the stages it runs on its host, which a run taking over from a
holder that died stops first: docs/pipeline.md, "Stopping a run, and taking over from one that died".
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import threading
import time
from contextlib import suppress

import fsspec

from llamarl.cluster.local import STOP_WAIT_S, kill_groups, process_start, survivors, wait_gone
from llamarl.lib.errors import UserError
from llamarl.lib.files import publish


class RunLocked(UserError):
    pass


class RunLock:
    """The run's lock, and the ``ProcessRegistry`` (cluster/executor.py) of its stages' processes."""

    def __init__(self, run_dir: str, lease_s: float = 120.0, echo=print):
        self.url = f"{run_dir.rstrip('/')}/pipeline/lock.json"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.lease_s, self.echo = lease_s, echo
        self.me = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                   "pid_start": process_start(os.getpid()), "pid_ns": _pid_namespace(), "started": time.time(),
                   "lease_s": lease_s, "stages": {}}
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: the heartbeat rewrites the lock now, not at its next beat
        self._thread: threading.Thread | None = None
        self._writing = threading.Lock()  # the heartbeat's writes and the stages' records take turns

    # ---- acquire / release ---------------------------------------------------------------------

    def acquire(self) -> None:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        for _ in range(2):  # a second try after taking over a stale lock
            try:
                with self.fs.open(self.path, "xb") as f:
                    f.write(self._body())
                break
            except FileExistsError:
                self._take_over(self._read())
                self.fs.rm(self.path)
        else:
            raise RunLocked(f"{self.url}: another llamarl run took this run's lock at the same moment; try again")
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock — unless a stage's process outlived the stop
        (``STOP_WAIT_S`` after SIGKILL): then the lock stays, naming it, for the next run's takeover."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder = self._read()
            if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                left = _alive_stages(self.me["stages"])
                if left:
                    self._write()  # naming just the stages that still run
                    self.echo(f"{self.url} stays: {_listing(left)} still run; the next `llamarl run` stops them")
                else:
                    self.fs.rm(self.path)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def holder(self) -> str | None:
        """Who runs this run now, in words (None when nobody does, or the holder is gone)."""
        held = self._read()
        return None if not held or self._gone(held) is not None else _holding(held)

    # ---- the stages' processes (ProcessRegistry) --------------------------------------------------

    def started(self, name: str, groups: list[tuple[int, int | None]]) -> None:
        with self._writing:
            named = {tuple(p) for stage in self.me["stages"].values() for p in stage["procs"]}
            self.me["stages"][name] = {"host": self.me["host"], "procs": [list(g) for g in groups]}
            if self._thread is not None and not {tuple(g) for g in groups} <= named:
                self._write()  # new processes are in the lock before anything else happens
                return
        self._wake.set()

    def ended(self, name: str) -> None:
        with self._writing:
            if self.me["stages"].pop(name, None) is None:
                return
        self._wake.set()

    # ---- taking over -------------------------------------------------------------------------------

    def _gone(self, holder: dict) -> str | None:
        """Why the lock's ``holder`` no longer holds the run, or None while it does."""
        if holder.get("host") == self.me["host"]:
            return None if _alive(holder) else "its process is gone"
        age, lease = time.time() - holder.get("heartbeat", 0), holder.get("lease_s", self.lease_s)
        return f"no heartbeat for {age:.0f}s (lease {lease:.0f}s)" if age > lease else None

    def _take_over(self, holder: dict | None) -> None:
        """Say why ``holder``'s lock is taken over, after stopping what its stages left running on
        this host; RunLocked where it still holds the run, or its stages cannot be stopped."""
        if holder is None:
            self.echo(f"taking over the run lock of {_who(None)}")
            return
        why = self._gone(holder)
        if why is None:
            age = time.time() - holder.get("heartbeat", 0)
            stale = "" if age <= holder.get("lease_s", self.lease_s) else (
                f" (on this host, without a heartbeat: suspended? resume it with `kill -CONT {holder['pid']}`)")
            raise RunLocked(f"{self.url}: this run is being run by {_holding(holder)}{stale}; wait for it to finish, "
                            "or stop it first")
        stages = holder.get("stages") or {}
        if holder.get("host") == self.me["host"] and holder.get("pid_ns", self.me["pid_ns"]) == self.me["pid_ns"]:
            for name, pids in self._stop_stages(holder, stages).items():
                self.echo(f"stopped {name} of the previous run by {_who(holder)}, which is gone: its process(es) "
                          f"{', '.join(map(str, pids))} still ran")
        elif stages:  # on another host, or in another container (pid namespace) of this one: out of sight
            why += (f"; assuming its stages ended with it ({_listing(_pids(stages))} on {holder['host']}): if they "
                    f"still run there, stop them first ({_kill_command(stages)})")
        self.echo(f"taking over the run lock of {_who(holder)}: {why}")

    def _stop_stages(self, holder: dict, stages: dict) -> dict[str, list[int]]:
        """SIGKILL to the live process groups of a gone holder's ``stages`` on this host, waiting
        until they are gone; what was alive, by stage. RunLocked for what cannot be stopped."""
        alive = {}
        for name, entry in stages.items():
            groups = [tuple(g) for g in entry.get("procs", [])]
            try:
                killed = kill_groups(groups)
            except PermissionError:
                raise RunLocked(f"{self.url}: {name} of the previous run by {_who(holder)}, which is gone, still runs "
                                f"as {_listing(_pids({name: entry}))} of another user; stop them first "
                                f"({_kill_command({name: entry})}, as that user), then rerun") from None
            if killed:
                alive[name] = sorted(p for pids in killed.values() for p in pids)
        left = wait_gone([tuple(g) for e in stages.values() for g in e.get("procs", [])], STOP_WAIT_S)
        if left:
            raise RunLocked(f"{self.url}: process(es) {', '.join(map(str, left))} of the stages of the previous run by "
                            f"{_who(holder)} still run {STOP_WAIT_S:.0f}s after SIGKILL (stuck in I/O?); "
                            f"rerun once they are gone")
        return alive

    # ---- internals -------------------------------------------------------------------------------

    def _body(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": time.time()}).encode()

    def _read(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self) -> None:
        """The lock as it stands now, replacing the file whole. A write that fails (a full disk)
        leaves the last one in place and is tried again by the next heartbeat: the stage whose
        write failed too reports it."""
        with suppress(OSError):
            publish.replace(self.url, self._body())

    def _beat(self) -> None:
        """Every ``lease_s / 4``, and at once when woken: a stage ended, or one started on processes
        the lock already names (a resident worker's). Those writes are the heartbeat's, not the
        driver's: under a large output's write-back a rewrite of the lock can take a tenth of a
        second or more, and the next stage would wait for it."""
        while True:
            self._wake.wait(self.lease_s / 4)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._writing:
                self._write()


def _alive(holder: dict) -> bool:
    """Does the lock's holder, on this host, still run? Its pid alone is not enough: a driver
    container restarted in its pod has the same hostname and, as pid 1, the same pid as the one
    that died — but another start time."""
    pid = holder.get("pid")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's process, or no pid to check: assume it lives
    started, now = holder.get("pid_start"), process_start(int(pid))
    return started is None or now is None or started == now


def _pid_namespace() -> int | None:
    """This process's pid namespace (its inode), where there is one: pids mean something only within it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _pids(stages: dict) -> dict[str, list[int]]:
    return {name: [g[0] for g in entry.get("procs", [])] for name, entry in stages.items()}


def _alive_stages(stages: dict) -> dict[str, list[int]]:
    """The live processes of ``stages``' process groups, by stage (those with any)."""
    alive = {name: survivors([tuple(g) for g in entry.get("procs", [])]) for name, entry in stages.items()}
    return {name: sorted(p for pids in found.values() for p in pids) for name, found in alive.items() if found}


def _listing(pids: dict[str, list[int]]) -> str:
    return "; ".join(f"{name}: process(es) {', '.join(map(str, p))}" for name, p in pids.items())


def _kill_command(stages: dict) -> str:
    return "kill -KILL -- " + " ".join(f"-{pid}" for pids in _pids(stages).values() for pid in pids)


def _holding(held: dict) -> str:
    """Who holds the run, since when, and how fresh its heartbeat is."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(held["started"]))
    return f"{_who(held)} since {started}, heartbeat {time.time() - held.get('heartbeat', 0):.0f}s ago"


def _who(holder: dict | None) -> str:
    return f"{holder['user']}@{holder['host']} (pid {holder['pid']})" if holder else "an unreadable lock"
