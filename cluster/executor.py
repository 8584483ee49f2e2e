"""The one interface of the executors (local, slurm, kubernetes): submit a stage, wait, report.

A stage is ``llamarl.stages.<stage>`` run with its config on ``nprocs`` processes spread evenly
over ``nodes`` machines, each with torchrun's environment. An executor's options are a pydantic
model checked when the spec loads (``kinds.validate_options``; docs/pipeline.md, "Executors").
"""

from __future__ import annotations

import json
import random
import socket
import sys
from typing import Any, Literal, Protocol

from llamarl.lib.errors import StageResult, UserError


class ProcessRegistry(Protocol):
    """Where an executor keeps the processes it starts on this host while they run (the run lock,
    pipeline/lock.py): a ``llamarl run`` that takes over from a driver that died finds them there."""

    def started(self, name: str, groups: list[tuple[int, int | None]]) -> None:
        """Stage ``name`` runs as these processes: (pid, start time in clock ticks since boot), each
        leading the process group of what it starts."""
        ...

    def ended(self, name: str) -> None:
        """No process of stage ``name`` lives any more."""
        ...


class Executor(Protocol):
    """Every executor subclasses it, for the defaults of an executor without a queue or a detached
    mode; an object with these members serves the pipeline too (a test's fake)."""

    registry: ProcessRegistry | None = None
    """Set by the pipeline before the first stage: where the processes started on this host are
    kept. Executors that start none here (slurm, kubernetes) never call it."""

    launches: bool = True
    """False for an executor that only writes what it would launch (kubernetes without ``apply``):
    ``submit`` then returns where it wrote it, and the pipeline writes every stage and runs none."""

    concurrency: int | None = None
    """Stages the pipeline may run at once when the DAG allows it; None: no limit of the executor's
    own (a cluster queues what it cannot run yet)."""

    detach: Literal["jobs", "driver"] | None = None
    """How ``llamarl run --detach`` works with this executor: ``jobs`` — every stage submitted at
    once, each after its inputs' jobs (``submit_after``); ``driver`` — one job in the cluster runs
    the resumable ``llamarl run`` (``start_driver``); None — it cannot (the local executor)."""

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> Any:
        """Start the stage and return a handle for ``wait``. ``name`` (default: the stage) names
        the job where the cluster shows one; the pipeline passes the node, e.g. iter-001/rollout."""
        raise NotImplementedError

    def wait(self, handle: Any) -> StageResult:
        """Block until the stage submitted as ``handle`` has ended."""
        raise NotImplementedError

    def run(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> StageResult:
        """``wait(submit(...))``."""
        return self.wait(self.submit(stage, config, nprocs, nodes, name=name))

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """What ``submit`` would launch, as text (for dry runs); starts and writes nothing."""
        raise NotImplementedError

    def prepare(self, stage: str, config: Any, nprocs: int, *, name: str | None = None) -> None:
        """A hint: the stage is next once the running stages end. An executor whose processes
        outlive a stage (resident workers) may get some ready for it meanwhile; it never writes
        the stage's output, and the stage runs the same whether or not this did anything."""

    def stop_all(self) -> list[str]:
        """The pipeline is stopping (a signal, Ctrl-C): stop what this executor started and still
        runs, where stopping it is this process's to do — local processes, every process of each
        stage, before it returns; a cluster's jobs stay queued or running, and a later ``llamarl
        run`` follows or resumes them. The names of the stages it stopped."""
        return []

    def close(self) -> None:
        """The run is over (done or failed; after ``stop_all`` too): let go of what the executor
        keeps between stages — the local executor's resident workers. Nothing of a stage runs."""

    def job_state(self, job_id: str) -> str | None:
        """What the cluster's queue says of a detached stage's job, e.g. ``PENDING (Dependency)``;
        None once it has left the queue, or where there is no queue."""
        return None

    def submit_after(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None,
                     after: list[str] = (), recorder: Any = None) -> str:
        """``detach == "jobs"``: submit the stage to start once the jobs ``after`` have succeeded
        (and never if one fails); ``recorder`` keeps its record from inside the job. The job id."""
        raise UserError(f"the {type(self).__name__} cannot submit a stage to start after others; "
                        f"--detach needs the slurm executor for that")

    def start_driver(self, spec_url: str, run_name: str) -> str:
        """``detach == "driver"``: start the job that runs ``llamarl run`` on ``spec_url`` in the
        cluster; where it is (its name, or the file it was written to)."""
        raise UserError(f"the {type(self).__name__} has no in-cluster driver; --detach needs the kubernetes executor "
                        f"for that")


def stage_args(stage: str, config: Any) -> list[str]:
    """The Python arguments of a stage process: ``-m llamarl.stages.STAGE --config-json JSON``."""
    return ["-m", f"llamarl.stages.{stage}", "--config-json", json.dumps(config.to_json())]


def stage_command(stage: str, config: Any) -> list[str]:
    return [sys.executable, *stage_args(stage, config)]


def _listening(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def free_port() -> int:
    """A port free on every interface of this host, for a stage's rendezvous (rank 0's store
    listens on it), drawn at random below the kernel's ephemeral range: outgoing connections take
    their ports from that range (as does binding port 0), so such a port may be taken between this
    check and the stage's own bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = 10000 if ephemeral_low > 12000 else 1024
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randint(low, max(low, ephemeral_low - 1))
        try:
            with _listening(port):
                return port
        except OSError:
            continue
    with _listening(0) as s:  # a crowded host: whatever the kernel gives
        return s.getsockname()[1]


def per_node(nprocs: int, nodes: int) -> int:
    """Processes on each node; a UserError where they do not spread evenly."""
    if nprocs < 1 or nodes < 1:
        raise UserError(f"{nprocs} processes on {nodes} nodes: a stage needs at least one of each")
    if nprocs % nodes:
        raise UserError(f"{nprocs} processes do not spread evenly over {nodes} nodes")
    return nprocs // nodes
