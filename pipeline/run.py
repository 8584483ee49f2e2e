"""Running a spec: its stages in order, resumed, in the foreground or detached.

The run directory's layout is docs/pipeline.md's first section; which stages are done, and why the
others run, its "Rules" (pipeline/records.py decides it); the stages wait, run and end in
pipeline/schedule.py.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

from llamarl.cluster.executor import Executor
from llamarl.cluster.kinds import make_executor
from llamarl.lib.errors import check_stop
from llamarl.lib.files import publish

from .checks import check_lr_schedule, check_prompts, check_storage
from .dag import Node, build_dag, check_spec, load_spec, may_run_beside
from .lock import RunLock
from .metrics import update_metrics
from .monitor import Monitor
from .records import plan, read_record, write_record
from .remakes import remade_as_it_was
from .retention import Trash, retire_done
from .schedule import PipelineError, Schedule, made_by_stage, now, record_end, update_metrics_after
from .spec import RunSpec


def executor_for(spec: RunSpec) -> Executor:
    return make_executor(spec.executor.kind, spec.executor.options, spec.run_dir, f"{spec.source}: executor.options")


def run_spec(spec: RunSpec, *, dry_run: bool = False, show_launch: bool = False, detach: bool = False,
             echo=print, executor: Executor | None = None) -> list[tuple[str, str]]:
    """Run every stage that is not done, in order. Returns (node, what happened) pairs. A dry run
    plans instead, and with ``show_launch`` echoes what the executor would launch for each stage
    that would run (``Executor.render``). ``executor``: one to use instead of the spec's."""
    run = spec.run_dir
    nodes = check_spec(spec)
    check_storage(spec)
    by_name = {n.name: n for n in nodes}
    if dry_run:
        check_lr_schedule(spec, check_prompts(spec, record=False))
        report = []
        executor = (executor or executor_for(spec)) if show_launch else None
        beside = may_run_beside(nodes)
        states = plan(run, nodes, by_name)
        for n in nodes:
            done, why = states[n.name]
            if not done:
                if executor is not None:
                    echo(executor.render(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name))
                if beside[n.name]:
                    why += f"; may run beside {beside[n.name]}"
            report.append((n.name, ("skip: " if done else "run: ") + why))
        return report

    with RunLock(run, echo=echo) as lock:  # one `llamarl run` at a time per run directory
        executor = executor or executor_for(spec)
        executor.registry = lock  # the stages' processes on this host, for a takeover after a crash
        try:
            in_flight = _jobs_in_flight(run, nodes, executor)
            if in_flight:
                listed = ", ".join(f"{n} (job {j}: {state})" for n, j, state in in_flight[:3])
                raise PipelineError(f"{run}: stages of a detached run are still queued or running: {listed}"
                                    f"{' …' if len(in_flight) > 3 else ''}; follow them with `llamarl status {run}`, "
                                    f"or cancel them (scancel) before running it again")
            check_lr_schedule(spec, check_prompts(spec, record=True))
            if detach and executor.detach is None:
                raise PipelineError(f"{spec.source}: --detach needs a cluster executor (slurm or kubernetes); the "
                                    f"{spec.executor.kind} executor runs in the foreground")
            publish.replace(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
            if detach:
                return _submit_nodes(spec, nodes, by_name, executor, echo)
            return _run_nodes(spec, nodes, by_name, executor, echo)
        finally:
            executor.close()  # what it keeps between stages (resident workers) ends with the run


def _jobs_in_flight(run: str, nodes: list[Node], executor) -> list[tuple[str, str, str]]:
    """(node, job id, state) of the detached jobs of ``run`` still in the cluster's queue."""
    found = []
    for n in nodes:
        record = read_record(run, n) or {}
        if record.get("job") and record.get("status") in ("submitted", "running"):
            state = executor.job_state(record["job"])
            if state is not None:
                found.append((n.name, record["job"], state))
    return found


@dataclass(frozen=True)
class NodeRecorder:
    """A detached stage's record, kept from inside its job (rank 0) since no `llamarl run` waits on
    it: "running" when the job starts (again, after a requeue), "done" with its key or "failed" with
    the error when the stage ends. Picklable: it travels with the job."""

    run_dir: str
    node: str

    def _node(self) -> tuple[Node, list[Node], RunSpec]:
        spec = load_spec(f"{self.run_dir}/pipeline/spec.yaml")
        nodes = build_dag(spec)
        return next(n for n in nodes if n.name == self.node), nodes, spec

    def started(self, job_id: str) -> None:
        node, _, _ = self._node()
        write_record(self.run_dir, node, status="running", job=job_id, started=now(), error=None)

    def ended(self, result) -> None:
        node, nodes, spec = self._node()
        by_name = {n.name: n for n in nodes}
        if result.ok:  # a remake that came out as it was keeps its id (its later stages were submitted all the same)
            remade_as_it_was(self.run_dir, node.name, made_by_stage(node))
        if record_end(spec, node, by_name, result):  # then what retention lets go of, and the run's metrics
            retire_done(spec, nodes, by_name)
            monitor = Monitor(spec)
            try:
                update_metrics_after(spec, node, monitor)
            finally:
                monitor.close()


def _submit_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
                  echo) -> list[tuple[str, str]]:
    """``--detach``: submit every stage that is not done at once, each job after the jobs of its
    inputs (Slurm: ``--dependency=afterok``), or start the executor's in-cluster driver; return
    without waiting."""
    run = spec.run_dir
    if executor.detach == "driver":
        # A driver job runs this same resumable `llamarl run` inside the cluster.
        where = executor.start_driver(f"{run}/pipeline/spec.yaml", spec.name)
        echo(f"driver: {where}" + ("" if executor.launches else " (apply it: kubectl apply -f)"))
        return [("driver", where)]
    schedule, jobs = Schedule(spec, nodes, by_name, executor, echo), {}
    schedule.detached = True
    # Every stage to submit is recorded "submitted" before the first job exists: a job that ends
    # before the last is submitted runs retention, which must not take a stage still to submit
    # for done (a remake's readers, whose keys its kept ids make current again). A submission
    # that fails gives the stages not submitted their records back, outputs untouched.
    todo: dict[str, tuple[Node, str, dict | None]] = {}
    for n in nodes:
        done, why = schedule.skipped(n, set(todo), clear=False)
        if not done:
            todo[n.name] = (n, why, read_record(run, n))
            write_record(run, n, status="submitted", job=None, after=[], submitted=now(), started=None, error=None,
                         key=None)
    for name, (n, why, _) in todo.items():
        after = [jobs[i] for i in n.inputs if i in jobs]
        try:
            schedule.clear(n, why)
            # Recorded before the job exists: a job that starts at once records "running" itself,
            # and the job id written after submitting must not take that back.
            write_record(run, n, after=after)
            job = executor.submit_after(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name,
                                        after=after, recorder=NodeRecorder(run, n.name))
        except BaseException:
            for m, _, record in list(todo.values())[len(jobs):]:
                if record is not None and m.name != name:
                    write_record(run, m, **record)
            raise
        jobs[n.name] = job
        write_record(run, n, job=job)
        schedule.report.append((n.name, f"submitted as job {job}"))
        echo(f"[{n.name}] submitted as job {job}" + (f", after {', '.join(after)}" if after else "") + f": {why}")
    return schedule.report


def _run_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
               echo) -> list[tuple[str, str]]:
    if not executor.launches:
        # Nothing runs here: every stage is written, and applying them in order runs the pipeline.
        report = []
        for n in nodes:
            where = executor.submit(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name)
            report.append((n.name, f"written {where}"))
            echo(f"[{n.name}] written: {where}")
        return report
    schedule = Schedule(spec, nodes, by_name, executor, echo)
    pool = ThreadPoolExecutor(max_workers=min(schedule.limit, len(nodes)), thread_name_prefix="stage")
    schedule.trash = Trash.open(spec.run_dir)
    try:
        if schedule.monitor.active:  # a resumed run: what the sinks missed while no `llamarl run` ran
            schedule.monitor.update(update_metrics(spec.run_dir, spec.iterations, spec.pass_threshold))
        while schedule.waiting or schedule.running:
            schedule.start_ready(pool)
            if not schedule.running:
                if schedule.failure is not None or not schedule.waiting:
                    break
                continue  # skipped stages made others ready
            # Now and then: a waiting stage may start from a part of a running one (Schedule.poll_s),
            # and a stop the interpreter dropped is raised again (errors.check_stop).
            ended, _ = wait(schedule.running, timeout=schedule.poll_s(), return_when=FIRST_COMPLETED)
            check_stop()
            schedule.step(ended, pool)
        schedule.metrics.close()  # the last metrics written, or their failure raised
    except BaseException as e:  # stopped (a signal, Ctrl-C) or failed: no stage process may outlive us
        schedule.stop(e)
        raise
    finally:
        schedule.metrics.stop()
        schedule.monitor.close()
        if schedule.trash is not None:
            schedule.trash.close()
        # Not waited for when stopped: a cluster's stage runs on, and so does the thread following it.
        pool.shutdown(wait=False, cancel_futures=True)
    return schedule.outcome()
