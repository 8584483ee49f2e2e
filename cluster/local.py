"""Local executor: a stage as N processes on this machine (CPU over gloo, or one per GPU over NCCL).

The processes get exactly the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so stage code cannot tell the
difference; starting them directly keeps the output to what the stage prints and the exit status
to the stage's own (2: a user error, reported in one line, which comes back as the result's
error). If one process dies, the others are stopped rather than left waiting in a collective.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llamarl.lib.errors import EXIT_USER_ERROR, UserError

from .executor import ExecutorBase, StageResult, free_port, per_node, stage_command


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads_per_process: int = Field(1, ge=1, description="OMP/intra-op threads each process may use (CPU runs).")
    grace_s: float = Field(30.0, ge=0, description="Seconds the other processes get to exit after one has failed.")
    max_concurrent_stages: int = Field(1, ge=1, description="Stages that may run at once when the DAG allows it "
                                                            "(max_staleness > 0: a rollout beside a ppo).")
    gpus: int = Field(0, ge=0, description="GPUs of this machine the stages share, one per process (0: none, or "
                                           "every stage takes GPUs 0..n-1). With gpus, a stage gets GPUs no "
                                           "running stage holds (CUDA_VISIBLE_DEVICES) and waits until enough "
                                           "are free.")


@dataclass
class LocalRun:
    """A started stage: its processes and what their stderr has told so far."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)
    error: str | None = None  # the stage's one-line error, once a process printed it
    gpus: list[int] = field(default_factory=list)  # held while it runs


class LocalExecutor(ExecutorBase):
    def __init__(self, options: LocalOptions | None = None, *, run_dir: str | None = None):
        """``run_dir`` is unused: the local executor writes nothing of its own."""
        self.options = options or LocalOptions()
        self.concurrency = self.options.max_concurrent_stages
        self._free_gpus = list(range(self.options.gpus))
        self._gpus_changed = threading.Condition()
        self._runs: list[LocalRun] = []  # started and not yet waited for

    def _take_gpus(self, n: int) -> list[int]:
        if not self.options.gpus:
            return []
        if n > self.options.gpus:
            raise UserError(f"a stage of {n} processes needs {n} GPUs; the local executor has gpus={self.options.gpus}")
        with self._gpus_changed:
            self._gpus_changed.wait_for(lambda: len(self._free_gpus) >= n)
            taken, self._free_gpus = self._free_gpus[:n], self._free_gpus[n:]
        return taken

    def _give_back(self, gpus: list[int]) -> None:
        with self._gpus_changed:
            self._free_gpus = sorted(self._free_gpus + gpus)
            self._gpus_changed.notify_all()

    def stop_all(self) -> None:
        """Kill every process this executor started that still runs (the pipeline was interrupted)."""
        for run in list(self._runs):
            for p in run.procs:
                if p.poll() is None:
                    p.kill()

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
        run = LocalRun(gpus=self._take_gpus(nprocs))
        devices = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, run.gpus))} if run.gpus else {}
        port = free_port()
        self._runs.append(run)
        for rank in range(nprocs):
            proc = subprocess.Popen(self.command(stage, config),
                                    env={**os.environ, **self._env(rank, nprocs, port), **devices},
                                    stderr=subprocess.PIPE, text=True, bufsize=1)
            reader = threading.Thread(target=_forward, args=(proc.stderr, run), daemon=True)
            reader.start()
            run.procs.append(proc)
            run.readers.append(reader)
        return run

    def wait(self, handle: LocalRun) -> StageResult:
        try:
            code = self._wait(handle.procs)
        except KeyboardInterrupt:
            for p in handle.procs:
                p.kill()
            raise
        finally:
            self._give_back(handle.gpus)
            if handle in self._runs:
                self._runs.remove(handle)
        # The error line may still sit in a pipe after its process has gone: read them to the end.
        for reader in handle.readers:
            reader.join(timeout=10)
        if code == 0:
            return StageResult(0)
        return StageResult(code, handle.error or f"exit status {code}")


    def _wait(self, procs: list[subprocess.Popen]) -> int:
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                bad = [c for c in codes if c != 0]
                if not bad:
                    return 0
                return EXIT_USER_ERROR if all(c == EXIT_USER_ERROR for c in bad) else bad[0]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.options.grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.01)


def _forward(stream, run: LocalRun) -> None:
    """Pass a process's stderr through, remembering the stage's one-line error."""
    for line in stream:
        sys.stderr.write(line)
        if line.startswith("error: "):
            run.error = line[len("error: "):].strip()
