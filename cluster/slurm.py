"""Slurm executor: one submitit job per stage.

The job runs ``StageTask`` — a picklable callable — on ``nodes × tasks_per_node`` Slurm tasks,
one per rank. Inside each task, submitit's ``TorchDistributedEnvironment`` exports the torchrun
environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, …) for the whole allocation, so the
stage code runs unchanged across nodes.

Preemption and time-outs: ``StageTask.checkpoint`` asks submitit to resubmit the same task
(submitit requeues preempted jobs, and timed-out ones up to ``max_num_timeout`` times); a job
requeued by the cluster (``scontrol requeue``) simply starts again. Either way the stage resumes
from what it had already published.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field

from llamarl.lib.errors import UserError


class StageTask:
    """Run one stage in a Slurm task (picklable; resubmitted as is on preemption)."""

    def __init__(self, stage: str, config_class: str, config: dict):
        self.stage, self.config_class, self.config = stage, config_class, config

    def __call__(self) -> str:
        import importlib

        import submitit

        from llamarl.lib.job import parse_config

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        # Resolve the master's host name once, to IPv4: c10d otherwise looks it up again and again,
        # and where name service is slow (IPv6 lookups timing out) that adds minutes.
        os.environ["MASTER_ADDR"] = socket.gethostbyname(os.environ["MASTER_ADDR"])
        from llamarl.lib import parallel

        module = importlib.import_module(f"llamarl.stages.{self.stage}")
        cls = getattr(module, self.config_class)
        try:
            module.run(parse_config(cls, self.config, f"stage {self.stage}"))
        finally:
            parallel.shutdown()  # leave no process group behind: exit must not wait on peers
        return "ok"

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(StageTask(self.stage, self.config_class, self.config))


@dataclass
class SlurmExecutor:
    folder: str
    """Where submitit keeps job scripts, pickles and logs (on shared storage)."""
    partition: str | None = None
    account: str | None = None
    timeout_min: int = 60
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    max_num_timeout: int = 3
    """Requeues after time-outs (preemptions are always requeued)."""
    additional: dict = field(default_factory=dict)
    """Extra sbatch options, e.g. {constraint: h100, qos: high}."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the task (module loads, env activation)."""
    last_error: str | None = None
    last_job_id: str | None = None

    def _executor(self, name: str, nodes: int, tasks_per_node: int):
        import submitit

        ex = submitit.AutoExecutor(folder=os.path.join(self.folder, "%j"), slurm_max_num_timeout=self.max_num_timeout)
        params = dict(nodes=nodes, tasks_per_node=tasks_per_node, cpus_per_task=self.cpus_per_task,
                      timeout_min=self.timeout_min, name=f"llamarl-{name}", slurm_setup=list(self.setup),
                      slurm_additional_parameters=dict(self.additional))
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        if self.partition:
            params["slurm_partition"] = self.partition
        if self.account:
            params["slurm_additional_parameters"] = {**params["slurm_additional_parameters"], "account": self.account}
        ex.update_parameters(**params)
        return ex

    def submit(self, stage: str, config, nprocs: int, nodes: int = 1):
        if nprocs % nodes:
            raise UserError(f"{nprocs} processes do not spread evenly over {nodes} nodes")
        ex = self._executor(stage, nodes, nprocs // nodes)
        job = ex.submit(StageTask(stage, type(config).__name__, dataclasses.asdict(config)))
        self.last_job_id = job.job_id
        return job

    def run(self, stage: str, config, nprocs: int, nodes: int = 1) -> int:
        """Submit and wait; the exit status (0 or 1, with ``last_error`` set)."""
        job = self.submit(stage, config, nprocs, nodes)
        try:
            job.results()  # one result per task (rank)
            self.last_error = None
            return 0
        except Exception as e:  # submitit.core.utils.FailedJobError and friends
            lines = [line for line in str(e).splitlines() if "UserError:" in line or line.startswith("error: ")]
            detail = lines[-1].split("UserError:", 1)[-1].strip() if lines else f"{type(e).__name__}: {str(e)[:300]}"
            self.last_error = f"slurm job {job.job_id}: {detail}"
            return 1
