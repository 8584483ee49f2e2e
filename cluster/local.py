"""Local executor: a stage as N processes on this machine (CPU over gloo, or one per GPU over NCCL).

The processes get exactly the environment torchrun gives its workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so stage code cannot tell the
difference; starting them directly keeps the output to what the stage prints and the exit status
to the stage's own (2: a user error, already reported in one line). If one process dies, the
others are stopped rather than left waiting in a collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalExecutor:
    threads_per_process: int = 1
    """OMP/intra-op threads each process may use (CPU runs)."""
    grace_s: float = 30.0
    """How long the other processes get to exit after one has failed."""
    last_error: str | None = None

    def command(self, stage: str, config) -> list[str]:
        return [sys.executable, "-m", f"llamarl.stages.{stage}", "--config-json", json.dumps(asdict(config))]

    def run(self, stage: str, config, nprocs: int, nodes: int = 1) -> int:
        """Run ``llamarl.stages.<stage>`` with ``nprocs`` processes to completion; the exit status."""
        from llamarl.lib.errors import UserError

        if nprocs < 1:
            raise UserError(f"{stage}: {nprocs} processes; a stage needs at least one")
        if nodes != 1:

            raise UserError(f"the local executor runs on this machine only (nodes={nodes}); use slurm or kubernetes")
        port = free_port()
        procs = []
        for rank in range(nprocs):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                   "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(self.threads_per_process), "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(self.command(stage, config), env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
            threading.Thread(target=self._forward, args=(proc.stderr,), daemon=True).start()
            procs.append(proc)
        self.last_error = None
        try:
            return self._wait(procs)
        except KeyboardInterrupt:
            for p in procs:
                p.kill()
            raise

    def _forward(self, stream) -> None:
        """Pass a process's stderr through, remembering its one-line error (for run records)."""
        for line in stream:
            sys.stderr.write(line)
            if line.startswith("error: "):
                self.last_error = line[len("error: "):].strip()

    def _wait(self, procs) -> int:
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                bad = [c for c in codes if c != 0]
                return 0 if not bad else (2 if all(c == 2 for c in bad) else bad[0])
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
