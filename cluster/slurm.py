"""Slurm executor: one submitit job per stage, one task per rank (docs/pipeline.md, "Executors").

Each task runs ``StageTask``: torchrun's environment (submitit's ``TorchDistributedEnvironment``,
with a master port the tasks agree on), then the stage through a local process's entry point
(``job.execute``), so stage code runs unchanged across nodes. A preempted, timed-out or requeued
job starts again (``StageTask.checkpoint``) and the stage resumes from what it had published.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from typing import Any

import yaml
from pydantic import Field

from llamarl.lib.errors import UserError
from llamarl.lib.options import Strict

from .executor import Executor, StageResult, free_port, per_node, stage_args

PORT_WAIT_S = 300.0
"""How long tasks wait for rank 0's port: Slurm starts a job's tasks together, so only a rank 0
that died before publishing makes them wait this long."""


def agree_on_port(folder: str, rank: int, attempt: str, timeout_s: float = PORT_WAIT_S) -> int:
    """The master port of one attempt of a job, the same in every task.

    submitit derives the port from the job id alone, so a port already taken on the master node
    fails rank 0 with EADDRINUSE and leaves the other ranks waiting for it forever. Instead rank 0
    (on the master node) takes a port the kernel says is free there and publishes it in
    ``folder`` (the job's folder, on storage every node sees); the others wait for it. One file per
    ``attempt`` (Slurm's restart count), so a requeued job never reads its previous attempt's port.
    """
    path = os.path.join(folder, f"master_port.{attempt}")
    if rank == 0:
        port = free_port()
        with open(f"{path}.tmp", "w") as f:
            f.write(str(port))
        os.replace(f"{path}.tmp", path)  # whole, or not there: a reader never sees half a number
        return port
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: rank 0 published no master port within {timeout_s:.0f} s; see rank 0's log")
        time.sleep(0.1)
    with open(path) as f:
        return int(f.read())


class StageTask:
    """Run one stage in a Slurm task (picklable; resubmitted as is on preemption).

    ``recorder`` (a detached run's, see ``SlurmExecutor.submit``): an object with ``started(job_id)``
    and ``ended(result)``, called on rank 0 around the stage, so the run's records are kept with no
    ``llamarl run`` waiting; a failed stage then also fails its job, so that Slurm cancels the jobs
    that depend on it (``--kill-on-invalid-dep``)."""

    def __init__(self, stage: str, config: dict, recorder: Any = None):
        self.stage, self.config, self.recorder = stage, config, recorder

    def __call__(self) -> StageResult:
        import importlib

        import submitit

        from llamarl.lib.runtime import job
        from llamarl.stages.config import STAGES

        task = submitit.JobEnvironment()
        environment = submitit.helpers.TorchDistributedEnvironment()
        environment.master_port = agree_on_port(str(task.paths.folder), task.global_rank,
                                                attempt=os.environ.get("SLURM_RESTART_COUNT", "0"))
        environment.export(set_cuda_visible_devices=False)
        # Resolve the master's host name once, to IPv4: c10d otherwise looks it up again and again,
        # and where name service is slow (IPv6 lookups timing out) that adds minutes.
        os.environ["MASTER_ADDR"] = socket.gethostbyname(os.environ["MASTER_ADDR"])
        module = importlib.import_module(f"llamarl.stages.{self.stage}")
        recorder = self.recorder if task.global_rank == 0 else None  # rank 0 keeps the record
        if recorder is not None:
            recorder.started(str(task.job_id))
        try:
            result = job.execute(STAGES[self.stage], module.run, ["--config-json", json.dumps(self.config)])
        except Exception as e:  # a bug: its traceback goes to the job's log, its one line to the record
            if recorder is not None:
                first = (str(e).strip().splitlines() or [""])[0][:200]
                recorder.ended(StageResult(1, f"{type(e).__name__}: {first} (log: {task.paths.stderr})"))
            raise
        if recorder is not None:
            recorder.ended(result)
        if self.recorder is not None and not result.ok:
            raise StageFailed(result.error)
        return result

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(StageTask(self.stage, self.config, self.recorder))


class StageFailed(RuntimeError):
    """A detached stage's failure, raised so that Slurm marks its job failed."""


class SlurmOptions(Strict):
    folder: str | None = Field(None, description="Where submitit keeps job scripts, pickles and logs, on storage "
                                                 "every node sees; default RUN/pipeline/slurm.")
    partition: str | None = Field(None, description="Slurm partition; default: the cluster's.")
    account: str | None = Field(None, description="Slurm account to charge.")
    timeout_min: int = Field(60, ge=1, description="Time limit of each stage's job, in minutes.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (one process per GPU).")
    cpus_per_task: int = Field(1, ge=1, description="CPUs of each task (process).")
    max_num_timeout: int = Field(3, ge=0, description="Requeues after time-outs (preemptions are always requeued).")
    additional: dict[str, str | int | bool] = Field(default_factory=dict,
                                                    description="Extra sbatch options, e.g. {constraint: h100, qos: high}.")
    setup: list[str] = Field(default_factory=list, description="Shell lines run before the tasks (module loads, "
                                                               "environment activation).")


class SlurmExecutor(Executor):
    detach = "jobs"

    def __init__(self, options: SlurmOptions, *, run_dir: str | None = None):
        """``run_dir``: the run whose stages this executor submits; ``folder`` defaults to its
        ``pipeline/slurm``."""
        if options.folder is None:
            if run_dir is None:
                raise UserError("slurm executor: set folder (where submitit keeps its files, on shared storage)")
            options = options.model_copy(update={"folder": f"{run_dir.rstrip('/')}/pipeline/slurm"})
        self.options = options

    def _parameters(self, stage: str, nprocs: int, nodes: int, name: str | None, after: list[str] = ()) -> dict[str, Any]:
        """The parameters of submitit's ``update_parameters`` for one stage; ``after``: the jobs it
        waits for (``--dependency=afterok``); it is cancelled if one of them fails."""
        o = self.options
        additional = dict(o.additional) | ({"account": o.account} if o.account else {})
        if after:
            additional |= {"dependency": "afterok:" + ":".join(after), "kill_on_invalid_dep": "yes"}
        params: dict[str, Any] = dict(nodes=nodes, tasks_per_node=per_node(nprocs, nodes), cpus_per_task=o.cpus_per_task,
                                      timeout_min=o.timeout_min, name=f"llamarl-{(name or stage).replace('/', '-')}",
                                      slurm_setup=list(o.setup), slurm_additional_parameters=additional)
        if o.gpus_per_node:
            params["gpus_per_node"] = o.gpus_per_node
        if o.partition:
            params["slurm_partition"] = o.partition
        return params

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """submitit's parameters of the job, and what each of its tasks runs."""
        params = self._parameters(stage, nprocs, nodes, name)
        return (f"# a submitit job in {self.options.folder}/%j; its parameters:\n"
                + yaml.safe_dump(params, sort_keys=False)
                + f"# each of its {nprocs} tasks runs, in torch.distributed's environment:\n"
                + shlex.join(["python", *stage_args(stage, config)]))

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None,
               after: list[str] = (), recorder: Any = None):
        """Submit the stage's job; the submitit ``Job``. A detached run passes ``after`` (job ids
        this one waits for) and a ``recorder`` (see ``StageTask``)."""
        import submitit

        ex = submitit.AutoExecutor(folder=os.path.join(self.options.folder, "%j"),
                                   slurm_max_num_timeout=self.options.max_num_timeout)
        ex.update_parameters(**self._parameters(stage, nprocs, nodes, name, list(after)))
        return ex.submit(StageTask(stage, config.to_json(), recorder))

    def submit_after(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None,
                     after: list[str] = (), recorder: Any = None) -> str:
        """``submit`` for a detached run: the job id, for the jobs after it and for ``job_state``."""
        return str(self.submit(stage, config, nprocs, nodes, name=name, after=after, recorder=recorder).job_id)

    def job_state(self, job_id: str) -> str | None:
        """What Slurm says of a job still in its queue, e.g. ``PENDING (Dependency)`` or ``RUNNING``;
        None once it has left the queue (ended, cancelled)."""
        import subprocess

        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True,
                                 timeout=60).stdout.split()
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UserError(f"cannot ask Slurm about job {job_id} (squeue: {e}); run this where Slurm's commands work") from None
        if not out or out[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            return None
        reason = out[1] if len(out) > 1 and out[1] not in ("None", "(null)") else None
        return f"{out[0]} ({reason})" if reason else out[0]

    def wait(self, handle) -> StageResult:
        """The first failed task's result (by rank), or success."""
        try:
            results: list[StageResult] = handle.results()  # one per task
        except Exception as e:  # the task crashed, or the job was cancelled or lost: no result to read
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return StageResult(1, f"slurm job {handle.job_id}: {type(e).__name__}: {first} (log: {handle.paths.stderr})")
        failed = next((r for r in results if not r.ok), None)
        if failed is None:
            return StageResult(0)
        return StageResult(failed.code, f"slurm job {handle.job_id}: {failed.error}")

