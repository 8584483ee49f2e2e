"""The local executor with resident workers (``resident: true``; docs/cluster.md, "Resident
workers"): one worker process per rank, started once per ``llamarl run``, runs stage after stage
as calls (cluster/worker.py), so that a stage's start costs no process start, no imports, no CUDA
context. Everything else is the local executor's (cluster/local.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from llamarl.lib.errors import PARENT_ENV, UserError

from .executor import free_port, stage_args
from .local import STOP_WAIT_S, LocalExecutor, LocalOptions, LocalRun, kill_groups, pass_on, process_start, wait_gone
from .worker import END

POOL = "resident workers"
"""The registry's name for the workers' processes (beside each running stage's own name)."""

SETTLE_S = 1.0  # how long a dead worker's last lines (its error, its END) may take to come through
QUIT_WAIT_S = 10.0  # how long a worker told to leave (its stdin closed) may take
WARM = ("llamarl.stages.rollout", "llamarl.stages.score", "llamarl.stages.ppo",
        "transformers.models.auto.tokenization_auto", "torch.distributed.checkpoint.filesystem")
"""What a spare worker imports (``_start_spares``): the stages of an iteration, and what they
import on their first call (the tokenizer's transformers: seconds; DCP's classes, which reading
or writing a checkpoint's ``.metadata`` needs: half a second)."""


@dataclass(eq=False)
class Worker:
    """A worker process and the stage it serves now (``run``, as rank ``rank``)."""

    slot: int
    proc: subprocess.Popen
    start: int | None
    run: ResidentRun | None = None
    rank: int = 0
    reader: threading.Thread | None = None

    @property
    def group(self) -> tuple[int, int | None]:
        return self.proc.pid, self.start

    def send(self, request: dict) -> None:
        with suppress(BrokenPipeError, ValueError):  # it died: its exit status is the rank's
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()

    def read(self) -> None:
        """Pass the worker's stderr through to the stage it serves; ``END`` lines are its results."""
        for line in self.proc.stderr:
            run, rank = self.run, self.rank
            if line.startswith(END):
                if run is not None:
                    run.codes[rank] = int(line.split()[1])
                continue
            pass_on(line, run, rank)


@dataclass(eq=False)
class ResidentRun(LocalRun):
    """A stage running on workers: ``procs`` are theirs; a rank's status is what its worker
    reported, or the worker's own exit status where it died first."""

    workers: list[Worker] = field(default_factory=list)
    codes: dict[int, int] = field(default_factory=dict)  # each rank's status, as its worker reported it
    dead_since: dict[int, float] = field(default_factory=dict)

    def status(self, rank: int) -> int | None:
        if rank in self.codes:
            return self.codes[rank]
        worker = self.workers[rank]
        code = worker.proc.poll()
        if code is None:
            return None
        since = self.dead_since.setdefault(rank, time.monotonic())
        if worker.reader.is_alive() and time.monotonic() - since < SETTLE_S:
            return None  # what it wrote last may still be in the pipe
        return self.codes.get(rank, code)


class ResidentExecutor(LocalExecutor):
    def __init__(self, options: LocalOptions | None = None, *, run_dir: str | None = None):
        super().__init__(options, run_dir=run_dir)
        self._workers: dict[int, Worker] = {}  # by slot: the GPU it is bound to, or an index
        # Linux's parent-death signal (``PARENT_ENV``) fires when the *thread* that started a
        # process ends: workers are started by this one thread, which lives until ``close``, never
        # by the pipeline's stage threads, which may end while the workers serve on.
        self._spawner: ThreadPoolExecutor | None = None
        self._spares = 0  # workers kept started (``_start_spares``)
        self._ran: dict[int, set[str]] = {}  # by slot: the stages its worker ran or got ready for
        self._readying: dict[int, str] = {}  # by slot: the stage its worker got ready for, until a stage runs there
        self._last: dict[str, list[int]] = {}  # by stage: the slots of its last run, rank by rank

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        return (f"# {name or stage}: run as a call in {nprocs} resident worker(s) (python -m llamarl.cluster.worker), "
                f"as these processes would run it\n" + super().render(stage, config, nprocs, nodes, name=name))

    # ---- workers ---------------------------------------------------------------------------------

    def _worker(self, slot: int) -> Worker:
        """The live worker of ``slot``, started if there is none (under ``_starting``)."""
        if self._live(slot):
            return self._workers[slot]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.options.threads_per_process), "PYTHONUNBUFFERED": "1",
               PARENT_ENV: str(os.getpid()), **self._device(slot)}
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix="worker-spawner")
        proc = self._spawner.submit(subprocess.Popen, [sys.executable, "-m", "llamarl.cluster.worker"], env=env,
                                    stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                    start_new_session=True).result()
        worker = Worker(slot, proc, process_start(proc.pid))
        worker.reader = threading.Thread(target=worker.read, name=f"worker-{slot}", daemon=True)
        worker.reader.start()
        self._workers[slot] = worker
        self._ran[slot] = set()  # a new worker has run nothing yet
        self._readying.pop(slot, None)
        self._register_pool()
        return worker

    def _live(self, slot: int) -> bool:
        worker = self._workers.get(slot)
        return worker is not None and worker.proc.poll() is None

    def _kept_slots(self) -> set[int]:
        return set(self._workers)

    def _slot_order(self, free: list[int], stage: str) -> list[int]:
        """The workers of ``stage``'s last run first, rank by rank: what it left in memory for the
        next run of it is there (ppo's models and training state, stages/ppo_kept.py); then the
        others that ran it, or got ready for it: what it left there stays warm (compiled kernels,
        CUDA graphs, the imports of its first call); then the other live workers, those getting
        ready for another stage last; then slots with no worker, which a start costs (seconds)."""
        last = self._last.get(stage, [])

        def rank(slot: int) -> tuple[int, int]:
            if not self._live(slot):
                return 3, slot
            if slot in last:
                return -1, last.index(slot)
            if stage in self._ran[slot]:
                return 0, slot
            return (2 if slot in self._readying else 1), slot

        return sorted(free, key=rank)

    def _stage_env(self, rank: int, nprocs: int, port: int | str, slot: int) -> dict[str, str]:
        """What a stage's rank ``rank`` on the worker of ``slot`` sees: its process's environment."""
        env = {**os.environ, **self._env(rank, nprocs, port), PARENT_ENV: str(os.getpid()), **self._device(slot)}
        if self.options.gpus:
            env["LOCAL_RANK"] = "0"  # its one visible GPU
        return env

    def _device(self, slot: int) -> dict[str, str]:
        """With ``gpus``, a worker sees its own GPU alone, for life."""
        return {"CUDA_VISIBLE_DEVICES": str(slot)} if self.options.gpus else {}

    def _register_pool(self) -> None:
        if self.registry is not None:
            live = [w.group for w in self._workers.values() if w.proc.poll() is None]
            if live:
                self.registry.started(POOL, live)
            else:
                self.registry.ended(POOL)

    # ---- stages --------------------------------------------------------------------------------------

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> ResidentRun:
        """Run ``llamarl.stages.<stage>`` as a call in ``nprocs`` workers."""
        self._check(nprocs, nodes)
        run = ResidentRun(name or stage)
        run.slots = self._take_slots(nprocs, run.name, stage)
        argv = stage_args(stage, config)[2:]  # what follows `-m llamarl.stages.STAGE`
        port = free_port()
        with self._starting:  # the stage handed to its workers, unless the run is stopping
            stopping = self._stopping
            if not stopping:
                self._runs.append(run)
                run.workers = [self._worker(slot) for slot in run.slots]
                run.procs, run.starts = [w.proc for w in run.workers], [w.start for w in run.workers]
                self._last[stage] = list(run.slots)
                for rank, worker in enumerate(run.workers):
                    worker.rank, worker.run = rank, run
                    self._ran[worker.slot].add(stage)
                    self._readying.pop(worker.slot, None)
                if self.registry is not None:
                    self.registry.started(run.name, run.groups)
                for rank, worker in enumerate(run.workers):
                    worker.send({"stage": stage, "argv": argv, "env": self._stage_env(rank, nprocs, port, worker.slot)})
                self._start_spares(nprocs)
        if stopping:
            self._give_slots(run.slots)
            raise UserError(f"{run.name}: not started: the run is stopping")
        return run

    def _start_spares(self, nprocs: int) -> None:
        """With stages beside each other, start the workers a second stage takes while the first
        runs (under ``_starting``), importing its modules, so that it never begins with a worker's
        imports (docs/cluster.md says why). A spare takes no GPU memory until a stage runs in it."""
        self._spares = max(self._spares, nprocs * self.concurrency)
        if self.concurrency < 2:
            return
        for slot in range(min(self._spares, self.options.gpus or self._spares)):
            if not self._live(slot):
                self._worker(slot).send({"warm": list(WARM)})

    def prepare(self, stage: str, config: Any, nprocs: int, *, name: str | None = None) -> None:
        """With stages beside each other, idle workers (spares first, started where none is) get
        ready for a stage that ``prepares`` while others run; it runs on them next (``_slot_order``).
        Nothing when live workers ran it or got ready for it already."""
        if self.concurrency < 2 or not type(config).prepares:
            return
        self._spares = max(self._spares, nprocs * self.concurrency)
        with self._starting:
            if self._stopping or sum(self._live(s) and stage in ran for s, ran in self._ran.items()) >= nprocs:
                return
            with self._slots_changed:
                # Without ``gpus``, a worker more where every spare is busy (``max_staleness: 1``'s
                # first rollouts, side by side): what it gets ready for is the next critical stage.
                pool = range(self.options.gpus or self._spares + nprocs)
                free = [s for s in pool if s not in self._busy]
            # Spares first (a stage that starts now takes a worker that ran something), then the others.
            slots = sorted(free, key=lambda s: (not self._live(s), bool(self._ran.get(s)), s))[:nprocs]
            if len(slots) < nprocs:
                return
            argv, port = stage_args(stage, config)[2:], free_port()
            for rank, slot in enumerate(slots):
                self._worker(slot).send({"prepare": {"stage": stage, "argv": argv,
                                                     "env": self._stage_env(rank, nprocs, port, slot)}})
                self._ran[slot].add(stage)
                self._readying[slot] = stage

    def _end(self, run: ResidentRun) -> None:
        """The stage has ended: its workers are free, the dead ones gone (and replaced when their
        slot is next needed), its slots given back."""
        with self._starting:
            for worker in run.workers:
                worker.run = None
            dead = [w for w in run.workers if w.proc.poll() is not None]
            for worker in dead:
                if self._workers.get(worker.slot) is worker:
                    del self._workers[worker.slot]
            if run in self._runs:
                self._runs.remove(run)
        if dead:  # what a dead worker started goes with it
            kill_groups([w.group for w in dead])
        self._reap(run, [w.group for w in dead], [w.proc for w in dead])
        with self._starting:
            self._register_pool()
        self._give_slots(run.slots)

    # ---- the end of the run ----------------------------------------------------------------------------

    def stop_all(self) -> list[str]:
        """Start nothing more; kill every worker, busy or idle, with what it started, and wait until they are gone."""
        with self._starting:
            self._stopping = True
            runs, workers = list(self._runs), list(self._workers.values())
        with self._slots_changed:
            self._slots_changed.notify_all()  # a stage waiting for GPUs gives up
        self._kill(workers)
        return [run.name for run in runs]

    def close(self) -> None:
        """The run is over: every worker leaves (its stdin closed), what it started with it."""
        with self._starting:
            workers = list(self._workers.values())
        for worker in workers:
            with suppress(OSError):
                worker.proc.stdin.close()
        deadline = time.monotonic() + QUIT_WAIT_S
        for worker in workers:
            with suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._kill(workers)
        with self._starting:
            spawner, self._spawner = self._spawner, None
        if spawner is not None:
            spawner.shutdown()

    def _kill(self, workers: list[Worker]) -> None:
        """Kill ``workers`` with what they started and wait until none of their processes lives."""
        groups = [w.group for w in workers]
        kill_groups(groups)
        left = wait_gone(groups, STOP_WAIT_S, reap=[w.proc for w in workers])
        with self._starting:
            for worker in workers:
                if self._workers.get(worker.slot) is worker:
                    del self._workers[worker.slot]
            if not left:
                self._register_pool()
