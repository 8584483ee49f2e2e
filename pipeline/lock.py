"""One ``llamarl run`` per run directory: a lock file on the shared storage, with a heartbeat.

``RUN/pipeline/lock.json`` holds who runs the run (user, host, pid), since when, and a heartbeat
that a thread refreshes every ``lease_s / 4`` seconds. It is created exclusively (``xb``), so of two
runs started together one wins; the other exits at once saying who holds the run. A lock whose
heartbeat is older than its lease belongs to a run that died (a killed login session, a lost node):
the next ``llamarl run`` takes it over and says so — at once when the holder was on this host and
its process is gone (a killed ``llamarl run``, rerun by hand). Exclusive create is atomic on local and network
file systems (POSIX, NFS v3+); object stores without it get last-writer-wins, which the heartbeat
check after writing narrows but cannot close.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import threading
import time

import fsspec

from llamarl.lib.errors import UserError


class RunLocked(UserError):
    pass


class RunLock:
    def __init__(self, run_dir: str, lease_s: float = 120.0, echo=print):
        self.url = f"{run_dir.rstrip('/')}/pipeline/lock.json"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.lease_s, self.echo = lease_s, echo
        self.me = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                   "pid_start": _process_start(os.getpid()), "started": time.time(), "lease_s": lease_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquire / release ---------------------------------------------------------------------

    def acquire(self) -> None:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        for _ in range(2):  # a second try after taking over a stale lock
            try:
                with self.fs.open(self.path, "xb") as f:
                    f.write(self._body())
                break
            except FileExistsError:
                holder = self._read()
                age = time.time() - holder.get("heartbeat", 0) if holder else float("inf")
                dead_here = holder and holder.get("host") == self.me["host"] and not _alive(holder)
                if holder and not dead_here and age <= holder.get("lease_s", self.lease_s):
                    raise RunLocked(
                        f"{self.url}: this run is being run by {holder['user']}@{holder['host']} (pid {holder['pid']}) "
                        f"since {_when(holder['started'])}, heartbeat {age:.0f}s ago; wait for it to finish, or "
                        f"stop it first") from None
                why = "its process is gone" if dead_here else f"no heartbeat for {age:.0f}s (lease {self.lease_s:.0f}s)"
                self.echo(f"taking over the run lock of {_who(holder)}: {why}")
                self.fs.rm(self.path)
        else:
            raise RunLocked(f"{self.url}: another llamarl run took this run's lock at the same moment; try again")
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder = self._read()
            if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                self.fs.rm(self.path)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def holder(self) -> str | None:
        """Who runs this run now, in words (None when nobody does, or the holder is gone)."""
        held = self._read()
        if not held:
            return None
        age = time.time() - held.get("heartbeat", 0)
        gone = held.get("host") == self.me["host"] and not _alive(held)
        if gone or age > held.get("lease_s", self.lease_s):
            return None
        return f"{_who(held)} since {_when(held['started'])}, heartbeat {age:.0f}s ago"

    # ---- internals -------------------------------------------------------------------------------

    def _body(self) -> bytes:
        return json.dumps({**self.me, "heartbeat": time.time()}).encode()

    def _read(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            tmp = f"{self.path}.{self.me['pid']}.tmp"
            self.fs.pipe_file(tmp, self._body())
            self.fs.mv(tmp, self.path)


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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
    started, now = holder.get("pid_start"), _process_start(int(pid))
    return started is None or now is None or started == now


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _who(holder: dict | None) -> str:
    return f"{holder['user']}@{holder['host']} (pid {holder['pid']})" if holder else "an unreadable lock"
