"""Running a spec: the stage DAG, the run directory, the resume rules, status.

Run directory (``STORAGE/NAME``)::

    pipeline/spec.yaml          the spec of the latest ``llamarl run``
    pipeline/<node>.json        one record per stage: key, status, error, times, output id
    shard/actor  shard/rm       sharded initial actor and reward model
    iter-001/rollout  iter-001/scores  iter-001/ppo (actor/, critic/, train_state/, metrics.jsonl)
    …
    export/                     the final actor as an HF directory
    metrics.jsonl  metrics.png  per iteration: score, KL, losses

A stage's *key* hashes its stage config (minus where it runs) and the ids of its inputs' published
outputs. A stage is skipped when its output is published and its record holds the same key and
output id; otherwise its stale output is removed and it runs — and, since its output id changes,
so does everything downstream. A stage killed half-way leaves an unpublished output that the stage
itself resumes.

A stage that reads only part of an input's output (rollout and export: ppo's ``actor/``, published
before ppo's training state) is keyed by that part's id and may start as soon as it is published,
while the stage making it still runs (``Node.reads``; with an executor that runs several stages
at once).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import fsspec

from llamarl.cluster.executor import Executor, make_executor
from llamarl.lib import publish
from llamarl.lib.errors import Stopped, UserError
from llamarl.stages.config import ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig, StageConfig

from .spec import RunSpec, StageLayout


@dataclass
class Node:
    name: str  # e.g. "iter-002/ppo"
    stage: str  # module under llamarl.stages
    out: str
    inputs: list[str]  # upstream node names
    layout: StageLayout
    make_config: Callable[[], StageConfig]
    external: list[str] = dataclasses.field(default_factory=list)  # inputs from outside the run (HF dirs, prompts)
    # The part of an input's output that this stage reads, when only a part: {input node: sub-path},
    # e.g. {"iter-001/ppo": "actor"}. It is what the key names, and the stage may start once it is
    # published, before the input's stage ends.
    reads: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def nprocs(self) -> int:
        return self.layout.procs if self.stage == "export" else self.layout.world


class PipelineError(UserError):
    pass


def build_dag(spec: RunSpec) -> list[Node]:
    """The stages of ``spec`` in an order that respects their dependencies."""
    run, L = spec.run_dir, spec.layout

    def cfg(cls, options, where: str, **wired):
        return lambda: spec.stage_config(cls, options, where, **wired)

    nodes = [Node("shard/actor", "shard", f"{run}/shard/actor", [], L.shard,
                  cfg(ShardConfig, {}, "shard", src=spec.actor, dst=f"{run}/shard/actor", tp=L.shard.tp, pp=L.shard.pp),
                  external=[spec.actor])]
    if spec.reward_model:
        nodes.append(Node("shard/rm", "shard", f"{run}/shard/rm", [], L.shard,
                          cfg(ShardConfig, {}, "shard", src=spec.reward_model, dst=f"{run}/shard/rm", tp=L.shard.tp, pp=L.shard.pp),
                          external=[spec.reward_model]))
    def actor_dir(node: str) -> str:
        return f"{run}/{node}" if node == "shard/actor" else f"{run}/{node}/actor"

    def actor_only(node: str) -> dict[str, str]:
        """A ppo's actor/ is published before its training state: a stage that reads only the
        weights (rollout, export) need not wait for the rest."""
        return {} if node == "shard/actor" else {node: "actor"}

    actor, critic = "shard/actor", None
    trained = ["shard/actor"]  # trained[k]: the actor after k ppo updates
    for i in range(1, spec.iterations + 1):
        it = f"iter-{i:03d}"
        ro, sc, po = f"{it}/rollout", f"{it}/scores", f"{it}/ppo"
        # With staleness s, rollout i samples from the actor of ppo i-1-s, so it need not wait for
        # ppo i-1 … i-s: those run while it does.
        sampler = trained[max(0, i - 1 - spec.max_staleness)]
        nodes.append(Node(ro, "rollout", f"{run}/{ro}", [sampler], L.rollout,
                          cfg(RolloutConfig, spec.rollout, "rollout", actor=actor_dir(sampler), prompts=spec.prompts,
                              out=f"{run}/{ro}", tp=L.rollout.tp, dp=L.rollout.dp), external=[spec.prompts],
                          reads=actor_only(sampler)))
        rm = {"reward_model": f"{run}/shard/rm"} if spec.reward_model else {}
        nodes.append(Node(sc, "score", f"{run}/{sc}", [ro] + (["shard/rm"] if spec.reward_model else []), L.score,
                          cfg(ScoreConfig, spec.score, "score", rollout=f"{run}/{ro}", out=f"{run}/{sc}",
                              tp=L.score.tp, pp=L.score.pp, dp=L.score.dp, **rm)))
        critic_dir = f"{run}/{critic}/critic" if critic else None
        stale = {"off_policy": True} if sampler != actor else {}  # its samples are an older actor's
        nodes.append(Node(po, "ppo", f"{run}/{po}", [ro, sc, actor, "shard/actor"] + ([critic] if critic else []), L.ppo,
                          cfg(PPOConfig, spec.ppo, "ppo", rollout=f"{run}/{ro}", scores=f"{run}/{sc}",
                              actor=actor_dir(actor), reference=f"{run}/shard/actor", critic=critic_dir,
                              out=f"{run}/{po}", tp=L.ppo.tp, pp=L.ppo.pp, dp=L.ppo.dp, **stale)))
        # GRPO trains no critic: the next iteration starts its own only if it needs one.
        actor, critic = po, (po if spec.ppo.advantage == "gae" else None)
        trained.append(po)
    nodes.append(Node("export", "export", f"{run}/export", [actor], L.export,
                      cfg(ExportConfig, spec.export, "export", src=actor_dir(actor), dst=f"{run}/export"),
                      reads=actor_only(actor)))
    return nodes


def check_spec(spec: RunSpec) -> list[Node]:
    """The DAG, with every stage's config of every iteration built (validated) — before anything runs."""
    nodes = build_dag(spec)
    for n in nodes:
        n.make_config()
    return nodes


# ---- records and keys --------------------------------------------------------------------------------



def _record_url(run: str, node: Node) -> str:
    return f"{run}/pipeline/{node.name.replace('/', '.')}.json"


def read_record(run: str, node: Node) -> dict | None:
    fs, path = fsspec.core.url_to_fs(_record_url(run, node))
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def write_record(run: str, node: Node, **fields) -> dict:
    record = {**(read_record(run, node) or {}), **fields}
    publish.write_bytes(_record_url(run, node), json.dumps(record, indent=1).encode())
    return record


def published_id(url: str) -> str | None:
    return publish.output_id(url) if publish.read_manifest(url) is not None else None


def fingerprint(url: str, checksums: bool = False) -> str:
    """A content id of a file or folder outside the run: every file's name, size and modification
    time, and with ``checksums`` its checksum too (prompts: small; an HF checkpoint is not hashed on
    every `llamarl run`). Replacing or editing an input in place changes it (touching one without a
    change may too: a needless rerun, never a stale result)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return "missing"
    found = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
    entries = sorted((name[len(path):], info.get("size"), str(info.get("mtime") or info.get("LastModified") or info.get("ETag")),
                      publish.checksum(fs.unstrip_protocol(name)) if checksums else None)
                     for name, info in found.items())
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def _fingerprints(node: Node) -> dict[str, str]:
    # Prompts (read by rollout) are hashed whole; model folders by names, sizes and times.
    return {url: fingerprint(url, checksums=node.stage == "rollout") for url in node.external}


def input_url(node: Node, name: str, by_name: dict[str, Node]) -> str:
    """What ``node`` reads of its input ``name``: that node's output, or the part of it in ``node.reads``."""
    sub = node.reads.get(name)
    return f"{by_name[name].out}/{sub}" if sub else by_name[name].out


def node_key(node: Node, by_name: dict[str, Node]) -> str | None:
    """The node's key, or None while an input is not published yet: its config (where it runs
    aside), the output ids of what it reads of its inputs (a part's own id where it reads a part),
    and the fingerprints of its inputs from outside the run."""
    config = node.make_config().identity()
    inputs = {}
    for name in node.inputs:
        part = f"{name}/{node.reads[name]}" if name in node.reads else name
        inputs[part] = published_id(input_url(node, name, by_name))
        if inputs[part] is None:
            return None
    external = _fingerprints(node)
    body = json.dumps({"stage": node.stage, "config": config, "inputs": inputs, "external": external},
                      sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def assess(run: str, node: Node, by_name: dict[str, Node], will_run: set[str]) -> tuple[bool, str]:
    """(is it done, why) — for ``--dry-run`` and ``status``."""
    if any(i in will_run for i in node.inputs):
        return False, "an input will be redone"
    record = read_record(run, node)
    out_id = published_id(node.out)
    key = node_key(node, by_name)
    if record is None:
        return False, "not started"
    if record.get("status") in ("failed", "stopped"):
        return False, f"{record['status']}: {record.get('error')}"
    if record.get("status") == "running":
        job = f" as job {record['job']}" if record.get("job") else ""
        return False, f"running{job} or interrupted (started {record.get('started')})"
    if record.get("status") == "submitted":
        return False, f"submitted as job {record.get('job')} ({record.get('submitted')})"
    unfinished = next((i for i in node.reads if published_id(by_name[i].out) is None), None)
    if unfinished is not None:  # it read a part early; that stage's rerun writes the part again
        return False, f"{unfinished} is unfinished: its {node.reads[unfinished]}/ will be written again"
    if out_id is None:
        return False, "its output is missing"
    if record.get("key") != key:
        now = _fingerprints(node)
        changed = [url for url in node.external if (record.get("external") or {}).get(url) != now[url]]
        if changed:
            return False, f"{changed[0]} changed since it ran"
        return False, "its config or inputs changed"
    if record.get("output_id") != out_id:
        return False, "its output was replaced"
    return True, f"done {record.get('finished')}"


# ---- running ---------------------------------------------------------------------------------------------


def _beside(nodes: list[Node], by_name: dict[str, Node]) -> dict[str, list[str]]:
    """For each stage, the stages it may run at the same time with: neither needs the other's
    output, directly or not (with max_staleness > 0: a rollout and the ppo before it). The shards,
    which everything needs, are left out."""
    upstream: dict[str, set[str]] = {}
    for n in nodes:  # in DAG order: a node's inputs come first
        upstream[n.name] = set(n.inputs).union(*(upstream[i] for i in n.inputs))
    return {n.name: [m.name for m in nodes if m is not n and "shard" not in (m.stage, n.stage)
                     and m.name not in upstream[n.name] and n.name not in upstream[m.name]]
            for n in nodes}


def executor_for(spec: RunSpec) -> Executor:
    return make_executor(spec.executor.kind, spec.executor.options, spec.run_dir, f"{spec.source}: executor.options")


def check_storage(spec: RunSpec) -> None:
    """The run directory can live where the spec puts it: ``storage`` is no file and, on a local
    file system, a folder this user may write to (or may create) — checked before anything runs,
    dry runs too. A one-line error naming it otherwise. (An object store is not probed: that would
    mean writing to it.)"""
    import os

    fs, run = fsspec.core.url_to_fs(spec.run_dir)
    where = f"{spec.source}: storage"
    parts = run.rstrip("/").split("/")
    existing = next((p for p in ("/".join(parts[:i]) or "/" for i in range(len(parts), 0, -1)) if fs.exists(p)), None)
    if existing is not None and not fs.isdir(existing):
        raise PipelineError(f"{where}: {existing} is a file, not a folder; point storage at a folder (the run lives "
                            f"in STORAGE/NAME)")
    if "file" not in fs.protocol or existing is None:
        return
    for folder in dict.fromkeys(p for p in (existing, run, f"{run}/pipeline") if os.path.isdir(p)):
        if not os.access(folder, os.W_OK | os.X_OK):
            why = "read-only file system" if os.statvfs(folder).f_flag & os.ST_RDONLY else "permission denied"
            raise PipelineError(f"{where}: cannot write to {folder} ({why}); point storage at a folder you can "
                                f"write to")


def run_spec(spec: RunSpec, *, dry_run: bool = False, show_launch: bool = False, detach: bool = False,
             echo=print) -> list[tuple[str, str]]:
    """Run every stage that is not done, in order. Returns (node, what happened) pairs. A dry run
    plans instead, and with ``show_launch`` echoes what the executor would launch for each stage
    that would run (``Executor.render``)."""
    run = spec.run_dir
    nodes = check_spec(spec)
    check_storage(spec)
    by_name = {n.name: n for n in nodes}
    report, will_run = [], set()
    if dry_run:
        executor = executor_for(spec) if show_launch else None
        beside = _beside(nodes, by_name)
        for n in nodes:
            done, why = assess(run, n, by_name, will_run)
            if not done:
                will_run.add(n.name)
                if executor is not None:
                    echo(executor.render(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name))
                if beside[n.name]:
                    why += f"; may run beside {', '.join(beside[n.name])}"
            report.append((n.name, ("skip: " if done else "run: ") + why))
        return report

    from .lock import RunLock

    with RunLock(run, echo=echo) as lock:  # one `llamarl run` at a time per run directory
        executor = executor_for(spec)
        executor.registry = lock  # the stages' processes on this host, for a takeover after a crash
        in_flight = _jobs_in_flight(run, nodes, executor)
        if in_flight:
            listed = ", ".join(f"{n} (job {j}: {state})" for n, j, state in in_flight[:3])
            raise PipelineError(f"{run}: stages of a detached run are still queued or running: {listed}"
                                f"{' …' if len(in_flight) > 3 else ''}; follow them with `llamarl status {run}`, "
                                f"or cancel them (scancel) before running it again")
        if detach:
            return _submit_nodes(spec, nodes, by_name, executor, echo)
        return _run_nodes(spec, nodes, by_name, executor, echo)


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

    def _node(self) -> tuple[Node, dict[str, Node], RunSpec]:
        from .spec import load_spec

        spec = load_spec(f"{self.run_dir}/pipeline/spec.yaml")
        by_name = {n.name: n for n in build_dag(spec)}
        return by_name[self.node], by_name, spec

    def started(self, job_id: str) -> None:
        node, _, _ = self._node()
        write_record(self.run_dir, node, status="running", job=job_id, started=_now(), error=None)

    def ended(self, result) -> None:
        node, by_name, spec = self._node()
        if not result.ok:
            write_record(self.run_dir, node, status="failed", error=result.error, finished=None)
            return
        _record_done(self.run_dir, node, by_name)
        if node.stage == "ppo":
            from .metrics import update_metrics

            update_metrics(self.run_dir, spec.iterations)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _record_done(run: str, n: Node, by_name: dict[str, Node], key: str | None = None) -> None:
    """``key``: the node's key when it started, if known (an input read early could have been
    rewritten since: then the record keeps the key of what the stage read, which is now stale)."""
    write_record(run, n, status="done", key=key or node_key(n, by_name), output_id=published_id(n.out),
                 external=_fingerprints(n), finished=_now(), error=None)


def _remove_stale(n: Node, parts: set[str] = frozenset()) -> None:
    """Before ``n`` runs: its published output, whose config or inputs changed, removed; or, when
    it is unfinished, the ``parts`` of it that other stages read early (a killed run of ``n``
    published them): the stage writes them again, and nothing may start from the old ones."""
    fs, path = fsspec.core.url_to_fs(n.out)
    if published_id(n.out) is not None:
        fs.rm(path, recursive=True)
        return
    for part in parts:
        if published_id(f"{n.out}/{part}") is not None:
            fs.rm(f"{path}/{part}", recursive=True)


def _early_parts(nodes: list[Node]) -> dict[str, set[str]]:
    """For each node, the parts of its output that other nodes read before it ends."""
    parts: dict[str, set[str]] = {}
    for n in nodes:
        for name, sub in n.reads.items():
            parts.setdefault(name, set()).add(sub)
    return parts


def _skipped(run: str, n: Node, by_name: dict[str, Node], will_run: set[str], report: list, echo,
             parts: set[str] = frozenset()) -> tuple[bool, str]:
    """(is ``n`` done, why); a done stage is reported skipped, a stale output (or its ``parts``
    read early) removed before it runs."""
    done, why = assess(run, n, by_name, will_run)
    if done:
        report.append((n.name, "skipped (done)"))
        echo(f"[{n.name}] done, skipped")
    else:
        _remove_stale(n, parts)
    return done, why


def _submit_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
                  echo) -> list[tuple[str, str]]:
    """``--detach``: submit every stage that is not done at once, each job after the jobs of its
    inputs (Slurm: ``--dependency=afterok``), or start the executor's in-cluster driver; return
    without waiting."""
    run, report = spec.run_dir, []
    if executor.detach is None:
        raise PipelineError(f"{spec.source}: --detach needs a cluster executor (slurm or kubernetes); the "
                            f"{spec.executor.kind} executor runs in the foreground")
    publish.write_bytes(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
    if executor.detach == "driver":
        # A driver job runs this same resumable `llamarl run` inside the cluster.
        where = executor.start_driver(f"{run}/pipeline/spec.yaml", spec.name)
        echo(f"driver: {where}" + ("" if executor.launches else " (apply it: kubectl apply -f)"))
        return [("driver", where)]
    jobs: dict[str, str] = {}
    early = _early_parts(nodes)
    for n in nodes:
        done, why = _skipped(run, n, by_name, set(jobs), report, echo, early.get(n.name, set()))
        if done:
            continue
        after = [jobs[i] for i in n.inputs if i in jobs]
        # Recorded before the job exists: a job that starts at once records "running" itself, and
        # the job id written after submitting must not take that back.
        write_record(run, n, status="submitted", job=None, after=after, submitted=_now(), started=None, error=None,
                     key=None)
        job = executor.submit_after(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name, after=after,
                                    recorder=NodeRecorder(run, n.name))
        jobs[n.name] = job
        write_record(run, n, job=job)
        report.append((n.name, f"submitted as job {job}"))
        echo(f"[{n.name}] submitted as job {job}" + (f", after {', '.join(after)}" if after else "") + f": {why}")
    return report


def _run_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
               echo) -> list[tuple[str, str]]:
    run, report = spec.run_dir, []
    publish.write_bytes(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
    if not executor.launches:
        # Nothing runs here: every stage is written, and applying them in order runs the pipeline.
        for n in nodes:
            where = executor.submit(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name)
            report.append((n.name, f"written {where}"))
            echo(f"[{n.name}] written: {where}")
        return report
    # Every stage whose inputs are done starts, up to the executor's concurrency (the local
    # executor's max_concurrent_stages; a cluster queues what it cannot run yet): with
    # max_staleness > 0 a rollout runs beside the ppo before it. A stage that reads only a part
    # of a running input (Node.reads) starts once that part is published: polled, while there is
    # room for it.
    limit = executor.concurrency or len(nodes)
    early = _early_parts(nodes)
    waiting, finished, running, failure = list(nodes), set(), {}, None
    keys: dict[str, str | None] = {}  # each started node's key when it started

    def ready(n: Node) -> bool:
        # A part of a running input is this run's: the input's stale parts were removed when it started.
        started = {m.name for m in running.values()}
        return all(i in finished or (i in n.reads and i in started and published_id(input_url(n, i, by_name)))
                   for i in n.inputs)

    def may_start_early() -> bool:
        started = {m.name for m in running.values()}
        return failure is None and len(running) < limit and any(i in started for n in waiting for i in n.reads)

    with _StageThreads(max_workers=min(limit, len(nodes)), thread_name_prefix="stage") as pool:
        try:
            while waiting or running:
                for n in list(waiting) if failure is None else []:
                    if len(running) >= limit:
                        break
                    if not ready(n):
                        continue
                    waiting.remove(n)
                    done, why = _skipped(run, n, by_name, set(), report, echo, early.get(n.name, set()))
                    if done:
                        finished.add(n.name)
                        continue
                    early_from = [input_url(n, i, by_name)[len(run) + 1 :] for i in n.inputs if i not in finished]
                    if early_from:
                        why += f"; {', '.join(early_from)} published"
                    beside = f" (beside {', '.join(m.name for m in running.values())})" if running else ""
                    echo(f"[{n.name}] running {n.stage} on {n.nprocs} process(es): {why}{beside}")
                    write_record(run, n, status="running", started=_now(), error=None, key=None, job=None)
                    keys[n.name] = node_key(n, by_name)
                    running[pool.submit(executor.run, n.stage, n.make_config(), n.nprocs, n.layout.nodes,
                                        name=n.name)] = n
                if not running:
                    if failure is not None or not waiting:
                        break
                    continue  # skipped stages made others ready
                # About once a second while a waiting stage may start from a part of a running one.
                ended, _ = wait(running, timeout=1.0 if may_start_early() else None, return_when=FIRST_COMPLETED)
                for future in ended:
                    n, result = running.pop(future), future.result()
                    if not result.ok:
                        write_record(run, n, status="failed", error=result.error, finished=None)
                        failure = failure or (n, result)
                        continue
                    _finished(spec, n, by_name, keys.get(n.name))
                    finished.add(n.name)
                    report.append((n.name, "ran"))
        except BaseException as e:  # stopped (a signal, Ctrl-C) or failed: no stage process may outlive us
            _stop_stages(spec, executor, running, by_name, keys, e)
            raise
    if failure is not None:
        n, result = failure
        raise PipelineError(f"stage {n.name} failed ({result.error}); fix it and rerun `llamarl run` — finished stages are kept")
    return report


def _finished(spec: RunSpec, n: Node, by_name: dict[str, Node], key: str | None) -> None:
    """``n`` ended well: its record, and after a ppo the run's metrics."""
    _record_done(spec.run_dir, n, by_name, key)
    if n.stage == "ppo":
        from .metrics import update_metrics

        update_metrics(spec.run_dir, spec.iterations)


class _StageThreads(ThreadPoolExecutor):
    """The threads that follow running stages. Left by an exception (the driver stopping) it does
    not wait for them: a cluster's stage runs on, and so does the thread following it."""

    def __exit__(self, exc_type, exc, tb):
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
        return False


def _stop_stages(spec: RunSpec, executor: Executor, running: dict[Future, Node], by_name: dict[str, Node],
                 keys: dict[str, str | None], why: BaseException) -> None:
    """The driver stops (``why``: a signal, Ctrl-C, an error of its own). The executor stops what
    is its to stop — every process of each local stage, before it returns — and each stage's
    record says how it ended: done or failed if it ended just before the stop, else stopped. A
    cluster's job runs on and keeps its "running" record: a later ``llamarl run`` follows or
    resumes it."""
    stopped = set(executor.stop_all() or ())
    cause = why.name if isinstance(why, Stopped) else f"{type(why).__name__}: {why}".splitlines()[0][:200]
    ours = {f: n for f, n in running.items() if n.name in stopped or f.done()}
    wait(ours)  # a stopped stage's thread ends with its processes, which are gone now
    for future, n in ours.items():
        result = None if future.exception() is not None else future.result()
        if result is not None and result.ok:  # it ended well as the stop came
            _finished(spec, n, by_name, keys.get(n.name))
            stopped.discard(n.name)
        elif n.name in stopped:
            write_record(spec.run_dir, n, status="stopped", finished=None,
                         error=f"llamarl run stopped it at {_now()} ({cause}); rerun to resume")
        elif result is not None:  # it had failed on its own, just before the stop
            write_record(spec.run_dir, n, status="failed", error=result.error, finished=None)
    if isinstance(why, Stopped):
        why.stages = sorted(stopped)


def status(run: str) -> list[tuple[str, str, str]]:
    """(node, state, why) for the run directory ``run``."""
    from .spec import load_spec

    fs, path = fsspec.core.url_to_fs(f"{run.rstrip('/')}/pipeline/spec.yaml")
    if not fs.exists(path):
        raise UserError(f"{run} is not a run directory (no pipeline/spec.yaml); start it with `llamarl run SPEC`")
    spec = load_spec(f"{run.rstrip('/')}/pipeline/spec.yaml")
    nodes = build_dag(spec)
    by_name = {n.name: n for n in nodes}
    records = {n.name: read_record(spec.run_dir, n) or {} for n in nodes}
    executor = executor_for(spec)
    rows = []
    for n in nodes:
        record = records[n.name]
        done, why = assess(spec.run_dir, n, by_name, set())
        state = "done" if done else record.get("status", "pending")
        if state == "done" and not done:
            state = "stale"
        if state in ("submitted", "running") and record.get("job"):
            queued = executor.job_state(record["job"])
            if queued is not None:
                why = f"job {record['job']}: {queued}"
            else:  # left the queue without a record of its end: cancelled with a failed input, or lost
                failed = next((i for i in n.inputs if records[i].get("status") in ("failed", "cancelled", "lost")), None)
                state, why = (("cancelled", f"{failed} {records[failed]['status']}") if failed else
                              ("lost", f"job {record['job']} ended without reporting; see its log in "
                                       f"{spec.run_dir}/pipeline/slurm/{record['job']}"))
                record["status"] = state  # for the stages after it
        if n.stage == "rollout" and spec.max_staleness:
            why += f"; samples {n.inputs[0]}'s actor"
        beside = _ran_beside(n.name, records)
        if beside:
            why += f"; ran beside {', '.join(beside)}"
        rows.append((n.name, state, why))
    return rows


def _ran_beside(name: str, records: dict[str, dict]) -> list[str]:
    """The stages whose last run overlapped ``name``'s in time, from their records (to the second)."""
    mine = records[name]
    if not (mine.get("started") and mine.get("finished")):
        return []
    return [other for other, r in records.items() if other != name and r.get("started") and r.get("finished")
            and r["started"] < mine["finished"] and mine["started"] < r["finished"]]
