"""The base of every error a user can fix. Stage entry points print these as one line naming the
file and the fix, and exit with status ``EXIT_USER_ERROR`` (2); anything else is a bug and keeps its traceback."""

from dataclasses import dataclass


class UserError(Exception):
    pass


EXIT_USER_ERROR = 2
"""The exit status of a stage process that reported a ``UserError`` (executors and the Kubernetes
Job's failure policy read it as "already reported, do not retry")."""

EXIT_PEER_LOST = 3
"""The exit status of a stage process whose peer (another rank, another host) was lost mid-stage:
not the user's input, so an executor may run the stage again, and it resumes."""

EXIT_STATUS_ENV = "LLAMARL_EXIT_STATUS_FILE"
"""Set by a launcher that stands between the stage's processes and its own exit status — torchrun
in a Kubernetes pod exits 1 whatever its workers did — to a file where each failed process
appends ``STATUS ERROR``, so that the launcher can exit with the stage's own status (a user error
must fail the stage at once, not be retried)."""


@dataclass(frozen=True)
class StageResult:
    """How a stage ended, in one process (``job.execute``) or in all (an executor's ``wait``)."""

    code: int
    """The stage's exit status: 0, ``EXIT_USER_ERROR`` (a user error, in ``error``), or another failure."""
    error: str | None = None
    """Why it failed, in one line (the stage's own ``error: …`` where it reported one); None when ok."""

    @property
    def ok(self) -> bool:
        return self.code == 0


PARENT_ENV = "LLAMARL_PARENT_PID"
"""Set by the local executor to its own pid for the stage processes it starts: each dies with it
(``job.die_with_parent``)."""


class Stopped(KeyboardInterrupt):
    """A driver (``llamarl run``, ``llamarl stage``) told to stop by a signal: SIGINT, SIGTERM or
    SIGHUP (a closed ssh session, a deleted pod). It unwinds as Ctrl-C's KeyboardInterrupt does,
    so every path that stops the stages' processes on Ctrl-C stops them on the others too."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        self.stages: list[str] = []  # the stages the stop ended, for the driver's last line
        super().__init__(self.name)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention for a process ended by a signal


_stop: Stopped | None = None  # the stop a signal raised in this process, until ``forget_stop``


def raise_stop(signum: int) -> None:
    """A signal handler's stop: ``Stopped`` raised in the main thread, and kept for ``check_stop``."""
    global _stop
    _stop = Stopped(signum)
    raise _stop


def check_stop() -> None:
    """Raise again a stop that did not unwind the main thread. A signal's handler runs wherever the
    main thread is, and the interpreter prints and drops what it raises there inside a finalizer (a
    ``__del__``, a weakref callback): a driver's loop calls this between its waits, so that the
    stop is never lost."""
    if _stop is not None:
        raise _stop


def forget_stop() -> None:
    global _stop
    _stop = None


_DISK_FULL = {28: "no space left on device", 122: "disk quota exceeded"}  # ENOSPC, EDQUOT (Linux)


def disk_full(e: BaseException) -> str | None:
    """What ``e`` says when a write failed because its file system is full ("no space left on
    device", or the quota's "disk quota exceeded"), else None. It looks through the exceptions
    ``e`` was raised from, and at their messages too: a stage that gathers its ranks' errors passes
    them on as text (``OSError: [Errno 28] …`` inside a RuntimeError or a UserError)."""
    for x in chain(e):
        if isinstance(x, OSError) and x.errno in _DISK_FULL:
            return _DISK_FULL[x.errno]
        text = str(x)
        for code, words in _DISK_FULL.items():
            if f"[Errno {code}]" in text or words in text.lower():
                return words
    return None


def chain(e: BaseException | None):
    """``e`` and the exceptions it was raised from or while handling, innermost last."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def disk_full_error(path: str, words: str = _DISK_FULL[28]) -> str:
    """The one line of a stage or a driver whose write to ``path`` failed for ``words`` (``disk_full``'s)."""
    return (f"{path}: {words}; free space there, or set `retention: {{keep_last: N}}` in the run spec so older "
            f"iterations are deleted, then rerun: what was published is kept")


def one_line(text: str) -> str:
    """``text`` as one printable line: what a user's value in a message may hold and a terminal
    must not get — a newline, a NUL, an escape sequence, a right-to-left override, a lone
    surrogate (which no UTF-8 stream can even write) — written as Python escapes (``\\n``,
    ``\\x1b``, ``\\u202e``, ``\\ud800``). Every ``error: …`` line goes through it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def unreadable(e: OSError | UnicodeDecodeError) -> str:
    """Why a file the user named could not be read, in a few words (for a one-line error)."""
    if isinstance(e, UnicodeDecodeError):
        return "not a text file"
    if isinstance(e, IsADirectoryError):
        return "it is a folder"
    return e.strerror or type(e).__name__
