"""Local executor: a stage as N processes on this machine (CPU over gloo, or one per GPU over NCCL).

The processes get exactly the environment torchrun gives its workers, so stage code cannot tell
the difference; the result is the stage's own exit status and one-line error. If one process dies,
the others are stopped rather than left waiting in a collective. Each process leads a process
group of its own, in a session of its own, dies with the driver (``PARENT_ENV``) and is in the
``registry`` while it runs: docs/pipeline.md, "Stopping a run", says why.

``llamarl run`` runs the stages in resident workers by default (cluster/resident.py);
``resident: false`` and ``llamarl stage`` start the processes described here for every stage.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from llamarl.lib.errors import EXIT_USER_ERROR, PARENT_ENV, UserError, check_stop
from llamarl.lib.options import Strict

from .executor import Executor, StageResult, free_port, per_node, stage_command


MACHINE_MAX = 1024  # more cores or GPUs than one machine has: a typo (gpus: 1e9 would list a billion GPUs)


class LocalOptions(Strict):
    threads_per_process: int = Field(1, ge=1, le=MACHINE_MAX, description="OMP/intra-op threads each process may use "
                                                                          "(CPU runs).")
    grace_s: float = Field(30.0, ge=0, description="Seconds the other processes get to exit after one has failed.")
    max_concurrent_stages: int | None = Field(None, ge=1, description="Stages that may run at once when the DAG "
                                              "allows it: a rollout beside the training-state write of the ppo "
                                              "before it (its weights published), with max_staleness > 0 beside a "
                                              "whole ppo. Default: 2 on a machine with GPUs (the write is host "
                                              "work), 1 without (each stage's processes take the cores); 1 where "
                                              "a GPU has no room for a rollout beside a ppo's model and state.")
    gpus: int = Field(0, ge=0, le=MACHINE_MAX, description="GPUs of this machine the stages share, one per process (0: none, or "
                                           "every stage takes GPUs 0..n-1). With gpus, a stage gets GPUs no "
                                           "running stage holds (CUDA_VISIBLE_DEVICES) and waits until enough "
                                           "are free.")
    resident: bool = Field(True, description="Run the stages in resident workers: one process per rank, started "
                                             "once per `llamarl run`, running stage after stage as calls (imports, "
                                             "the CUDA context and compiled kernels stay; only files pass between "
                                             "stages). false: a new process per rank for every stage.")


@dataclass
class LocalRun:
    """A started stage: its processes and what their stderr has told so far."""

    name: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    starts: list[int | None] = field(default_factory=list)  # each process's start (``process_start``)
    readers: list[threading.Thread] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # each process's one-line error, once it printed it
    shown: set[str] = field(default_factory=set)  # the error lines passed on (several ranks may print one)
    shown_lock: threading.Lock = field(default_factory=threading.Lock)
    slots: list[int] = field(default_factory=list)  # held while it runs (``_take_slots``)
    gone: bool = False  # no process of its groups lives any more

    @property
    def groups(self) -> list[tuple[int, int | None]]:
        """(pid, start) of each process: the process group it leads."""
        return list(zip((p.pid for p in self.procs), self.starts))

    def status(self, rank: int) -> int | None:
        """Rank ``rank``'s exit status; None while it runs."""
        return self.procs[rank].poll()

    def error(self) -> str | None:
        """The stage's one-line error: of the first process (by rank) that exited with a user
        error, whose failure the others' (a lost peer) follow from; else of the first that printed one."""
        user = [i for i in range(len(self.procs)) if self.status(i) == EXIT_USER_ERROR and i in self.errors]
        first = user or sorted(self.errors)
        return self.errors[first[0]] if first else None


def has_gpus() -> bool:
    """Does this machine show its stages a GPU? Without importing torch: a device node of
    NVIDIA's or AMD's driver, and CUDA_VISIBLE_DEVICES not hiding them all."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


class LocalExecutor(Executor):
    def __init__(self, options: LocalOptions | None = None, *, run_dir: str | None = None):
        """``run_dir`` is unused: the local executor writes nothing of its own."""
        self.options = options or LocalOptions()
        self.concurrency = self.options.max_concurrent_stages or (2 if has_gpus() else 1)
        self._busy: set[int] = set()  # the slots of the running stages
        self._slots_changed = threading.Condition()
        self._runs: list[LocalRun] = []  # started and not yet waited for
        self._starting = threading.Lock()  # held while processes start, and while ``stop_all`` begins
        self._stopping = False  # set by stop_all: no process starts any more

    def _take_slots(self, n: int, name: str, stage: str = "") -> list[int]:
        """``n`` slots no running stage holds, one per process, those that suit ``stage`` best
        first (``_slot_order``): with ``gpus``, the GPUs it runs on, waiting until enough are free;
        without, as many as it asks for."""
        gpus = self.options.gpus
        if n > gpus > 0:
            raise UserError(f"a stage of {n} processes needs {n} GPUs; the local executor has gpus={gpus}")

        def free() -> list[int]:
            pool = range(gpus or max(self._busy | self._kept_slots(), default=-1) + 1 + n)
            return self._slot_order([s for s in pool if s not in self._busy], stage)[:n]

        with self._slots_changed:
            self._slots_changed.wait_for(lambda: len(free()) == n or self._stopping)
            if self._stopping:
                raise UserError(f"{name}: not started: the run is stopping")
            slots = free()
            self._busy.update(slots)
        return slots

    def _kept_slots(self) -> set[int]:
        """Slots that hold something between stages (none here: a stage's processes end with it)."""
        return set()

    def _slot_order(self, free: list[int], stage: str) -> list[int]:
        """The ``free`` slots in the order a ``stage`` takes them: the lowest first."""
        return free

    def _give_slots(self, slots: list[int]) -> None:
        with self._slots_changed:
            self._busy.difference_update(slots)
            self._slots_changed.notify_all()

    def stop_all(self) -> list[str]:
        """Start nothing more; kill the process groups of every running stage and wait until they are gone."""
        with self._starting:
            self._stopping = True
            runs = list(self._runs)
        with self._slots_changed:
            self._slots_changed.notify_all()  # a stage waiting for GPUs gives up
        for run in runs:
            kill_groups(run.groups)
        for run in runs:
            self._reap(run)
        return [run.name for run in runs]

    def _reap(self, run: LocalRun, groups: list | None = None, procs: list = ()) -> None:
        """Wait until no process of ``groups`` lives (default: ``run``'s, its processes reaped); then
        ``run`` leaves the registry, unless one still lives after ``STOP_WAIT_S``."""
        if groups is None:
            groups, procs = run.groups, run.procs
        left = wait_gone(groups, STOP_WAIT_S, reap=procs) if groups else []
        with self._starting:
            if not left and not run.gone:
                run.gone = True
                if self.registry is not None:
                    self.registry.ended(run.name)

    def command(self, stage: str, config: Any) -> list[str]:
        """The command line of every process of the stage (only their environments differ)."""
        return stage_command(stage, config)

    def _env(self, rank: int, nprocs: int, port: int | str) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(self.options.threads_per_process), "PYTHONUNBUFFERED": "1"}

    @staticmethod
    def _check(nprocs: int, nodes: int) -> None:
        per_node(nprocs, nodes)
        if nodes != 1:
            raise UserError(f"the local executor runs on this machine only (nodes={nodes}); use slurm or kubernetes")

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """One line per process: its environment and command."""
        self._check(nprocs, nodes)
        command = shlex.join(self.command(stage, config))
        lines = [f"# {name or stage}: {nprocs} process(es) on this machine; MASTER_PORT is a free port chosen at launch"]
        for rank in range(nprocs):
            env = self._env(rank, nprocs, "$MASTER_PORT")
            lines.append(" ".join(f"{k}={v}" for k, v in env.items()) + f" {command}")
        return "\n".join(lines)

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> LocalRun:
        """Start ``llamarl.stages.<stage>`` as ``nprocs`` processes."""
        self._check(nprocs, nodes)
        run = LocalRun(name or stage, slots=self._take_slots(nprocs, name or stage))
        devices = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, run.slots))} if self.options.gpus else {}
        port = free_port()
        with self._starting:
            self._runs.append(run)
        parent = {PARENT_ENV: str(os.getpid())}  # each process dies with this one (lib/runtime/job.py)
        for rank in range(nprocs):
            env = {**self._env(rank, nprocs, port), **devices, **parent}
            with self._starting:  # stop_all kills what started before it, and nothing starts after
                if self._stopping:
                    break
                proc = subprocess.Popen(self.command(stage, config), env={**os.environ, **env},
                                        stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
                run.procs.append(proc)
                run.starts.append(process_start(proc.pid))
        with self._starting:  # once stopping, stop_all has them: it kills them and they leave the registry
            if self.registry is not None and run.procs and not self._stopping:
                self.registry.started(run.name, run.groups)
        for i, proc in enumerate(run.procs):
            reader = threading.Thread(target=_forward, args=(proc.stderr, run, i), daemon=True)
            reader.start()
            run.readers.append(reader)
        if len(run.procs) < nprocs:
            self.wait(run)
            raise UserError(f"{run.name}: not started: the run is stopping")
        return run

    def wait(self, handle: LocalRun) -> StageResult:
        try:
            code = self._wait(handle)
        except KeyboardInterrupt:  # Ctrl-C or a signal (errors.Stopped) where this waits in the main thread
            kill_groups(handle.groups)
            self._end(handle)
            raise
        self._end(handle)
        return StageResult(0) if code == 0 else StageResult(code, handle.error() or f"exit status {code}")

    def _end(self, run: LocalRun) -> None:
        """The stage has ended: what its processes started and left behind (a tokenizer process
        still closing) goes with them; then its GPUs are given back."""
        kill_groups(run.groups)
        self._reap(run)
        self._give_slots(run.slots)
        with self._starting:
            if run in self._runs:
                self._runs.remove(run)
        # The error line may still sit in a pipe after its process has gone: read them to the end.
        for reader in run.readers:
            reader.join(timeout=10)

    def _wait(self, run: LocalRun) -> int:
        """The stage's exit status once every process has ended: 0, a user error where any process
        reported one (the others' failures, a lost peer, follow from it), else the first failure."""
        failed_at = None
        waits_for_driver = threading.current_thread() is threading.main_thread()  # `llamarl stage`
        while True:
            if waits_for_driver:
                check_stop()  # a stop the interpreter dropped (errors.check_stop)
            codes = [run.status(i) for i in range(len(run.procs))]
            if all(c is not None for c in codes):
                bad = [c for c in codes if c != 0]
                if not bad:
                    return 0
                return EXIT_USER_ERROR if EXIT_USER_ERROR in bad else bad[0]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.options.grace_s:
                kill_groups(run.groups)
            time.sleep(0.01)


def _forward(stream, run: LocalRun, index: int) -> None:
    """Pass process ``index``'s stderr through (``pass_on``)."""
    for line in stream:
        pass_on(line, run, index)


def pass_on(line: str, run: LocalRun | None, index: int) -> None:
    """Pass a line of rank ``index``'s stderr through, remembering its one-line error; an error line
    another process of the stage printed already is not shown again."""
    if run is not None and line.startswith("error: "):
        run.errors[index] = line[len("error: "):].strip()
        with run.shown_lock:
            if line in run.shown:
                return
            run.shown.add(line)
    with suppress(OSError):  # the driver's terminal is gone (SIGHUP): keep draining, so the stage never blocks
        sys.stderr.write(line)


# ---- process groups ------------------------------------------------------------------------------

STOP_WAIT_S = 30.0  # how long a killed process may take to go (one in uninterruptible I/O on NFS)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where unknown."""
    stat = _stat(pid)
    return stat[2] if stat else None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start) of process ``pid`` from /proc; None when it is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[2]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def survivors(groups: list[tuple[int, int | None]]) -> dict[int, list[int]]:
    """The live processes of each process group that a ``(pid, start)`` names — process ``pid``,
    started at ``start``, leads it: the process itself and what it started, also once it is gone —
    by leader, for the groups with any. A group whose ``pid`` now names another process has ended.
    Zombies are gone (only their exit status is left)."""
    if not os.path.isdir("/proc/self"):  # no /proc: a group's existence is all one can tell
        return {pid: [pid] for pid, _ in groups if _group_exists(pid)}
    wanted = dict(groups)
    members: dict[int, dict[int, int]] = {pid: {} for pid in wanted}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            state, group, started = stat
            if group in members and state != "Z":
                members[group][int(entry.name)] = started
    alive = {}
    for pid, found in members.items():
        start = wanted[pid]
        if pid in found and start is not None and found[pid] != start:
            continue  # the pid was reused: the group we knew has ended
        # Linux hands out no pid that still names a process group, so without their leader these
        # are its group's survivors; the start check guards against another pid namespace's numbers.
        if mine := sorted(p for p, started in found.items() if start is None or started >= start):
            alive[pid] = mine
    return alive


def _group_exists(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def kill_groups(groups: list[tuple[int, int | None]]) -> dict[int, list[int]]:
    """SIGKILL to each of ``groups`` that has a live process (``survivors``, which it returns).
    PermissionError: a group of another user's processes."""
    alive = survivors(groups)
    for pid in alive:
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return alive


def wait_gone(groups: list[tuple[int, int | None]], timeout_s: float, reap: list = ()) -> list[int]:
    """Wait until no process of ``groups`` lives (``reap``: our own children, polled so that they
    do not linger as zombies); the pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in reap:
            p.poll()
        alive = [q for qs in survivors(groups).values() for q in qs]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)
