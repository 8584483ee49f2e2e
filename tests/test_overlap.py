"""Overlapped iterations: with max_staleness 1, rollout k+1 samples from the actor of ppo k-1 and
runs while ppo k trains; the DAG, the stages' configs and the manifests say which actor each
rollout sampled from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from llamarl.cluster.executor import Executor
from llamarl.lib.files import publish
from llamarl.pipeline import demo
from llamarl.pipeline.dag import build_dag, load_spec
from llamarl.pipeline.run import run_spec


def _spec(tmp_path, staleness: int, **changes) -> str:
    path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(path))
    data.pop("validation")  # what overlaps here is training; validation's own scheduling: test_long_run.py
    data.update(max_staleness=staleness, **changes)
    out = tmp_path / f"staleness{staleness}.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


def test_with_staleness_1_rollout_k_samples_from_ppo_k_minus_2(tmp_path):
    spec = load_spec(_spec(tmp_path, 1, iterations=3))
    by = {n.name: n for n in build_dag(spec)}
    run = spec.run_dir
    assert by["iter-001/rollout"].inputs == by["iter-002/rollout"].inputs == ["shard/actor"]
    assert by["iter-003/rollout"].inputs == ["iter-001/ppo"]
    assert by["iter-003/rollout"].make_config().actor == f"{run}/iter-001/ppo/actor"
    # ppo trains the newest actor, on samples of an older one: off-policy from iteration 2 on.
    ppo1, ppo2 = by["iter-001/ppo"].make_config(), by["iter-002/ppo"].make_config()
    assert ppo1.actor == f"{run}/shard/actor" and not ppo1.off_policy
    assert ppo2.actor == f"{run}/iter-001/ppo/actor" and ppo2.off_policy
    assert "iter-001/ppo" in by["iter-002/ppo"].inputs


def test_staleness_0_is_the_sequential_chain(tmp_path):
    by = {n.name: n for n in build_dag(load_spec(_spec(tmp_path, 0, iterations=3)))}
    assert by["iter-002/rollout"].inputs == ["iter-001/ppo"] and by["iter-003/rollout"].inputs == ["iter-002/ppo"]
    assert not any(n.make_config().off_policy for n in by.values() if n.stage == "ppo")


def test_dry_run_shows_what_may_overlap(tmp_path):
    report = dict(run_spec(load_spec(_spec(tmp_path, 1, iterations=2)), dry_run=True, echo=lambda m: None))
    assert "may run beside iter-001/rollout, iter-001/scores, iter-001/ppo" in report["iter-002/rollout"]
    sequential = dict(run_spec(load_spec(_spec(tmp_path / "seq", 0, iterations=2)), dry_run=True, echo=lambda m: None))
    assert "beside" not in sequential["iter-002/rollout"]


@pytest.mark.slow
def test_overlapped_demo_runs_a_rollout_beside_a_ppo_and_the_score_rises(tmp_path):
    spec = _spec(tmp_path, 1, executor={"kind": "local", "options": {"max_concurrent_stages": 2}})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True,
                          text=True, timeout=1200)
    print(f"overlapped demo: {time.monotonic() - started:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    beside = re.findall(r"\[(iter-\d+/\w+)\] running \w+ .*\(beside ([^)]*)\)", proc.stdout)
    assert any(a.endswith("rollout") and "ppo" in b or a.endswith("ppo") and "rollout" in b for a, b in beside), beside
    run_dir = load_spec(spec).run_dir
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[-1]["mean_score"] > rows[0]["mean_score"], rows
    # The manifest says which actor each rollout sampled from.
    sampled = publish.read_manifest(os.path.join(run_dir, "iter-003", "rollout"))["request"]["actor_id"]
    assert sampled == publish.output_id(os.path.join(run_dir, "iter-001", "ppo", "actor"))
    assert publish.require_published(os.path.join(run_dir, "export"), "hf_export")
    # llamarl status: which actor each rollout samples, and which stages ran beside which.
    from llamarl.pipeline.status import status

    why = {name: why for name, state, why in status(run_dir)}
    assert "samples iter-001/ppo's actor" in why["iter-003/rollout"], why
    assert any("ran beside" in why[n] and "ppo" in why[n] for n in why if n.endswith("rollout")), why



def test_stages_that_overlap_for_under_a_second_ran_beside_each_other():
    from llamarl.pipeline.schedule import now
    from llamarl.pipeline.status import _ran_beside

    a_start = now()
    time.sleep(0.01)
    b_start = now()
    time.sleep(0.01)
    a_end = now()
    time.sleep(0.01)
    b_end = now()
    records = {"a": {"started": a_start, "finished": a_end}, "b": {"started": b_start, "finished": b_end},
               "c": {"started": b_end, "finished": now()}}
    assert _ran_beside("a", records) == ["b"] and _ran_beside("c", records) == []

# ---- early start: a stage that reads only ppo's actor/ starts once it is published --------------------


class _PublishingExecutor(Executor):
    """Stages that only publish their outputs, as the real ones order them: ppo, after its start-up
    (``pause`` seconds: it clears what a killed run left only then), its ``actor/`` first, then,
    ``pause`` seconds later (its training state being written), the rest; a rollout after a fifth
    of ``pause`` (what starts beside it sees it running, on a loaded machine too). Each stage's
    start and end (monotonic) land in ``events``; ppo's actor/ publication as ``<node>: actor/``."""

    launches = True

    def __init__(self, concurrency: int, pause: float = 2.5):
        self.concurrency, self.pause, self.events = concurrency, pause, {}
        self.prepared: dict[str, float] = {}  # the stages the pipeline said come next, and when

    def prepare(self, stage, config, nprocs, *, name=None):
        assert name not in self.prepared, f"{name} prepared twice"
        self.prepared[name] = time.monotonic()

    def run(self, stage, config, nprocs, nodes=1, *, name=None):
        from llamarl.cluster.executor import StageResult

        self.events[name] = [time.monotonic(), None]
        out = getattr(config, "out", None) or config.dst
        if stage in ("ppo", "rollout"):
            time.sleep(self.pause if stage == "ppo" else self.pause / 5)
        publish.prepare(out, lambda m: False)
        if stage == "ppo":
            publish.prepare(f"{out}/actor", lambda m: False)
            publish.publish(f"{out}/actor", {"kind": "checkpoint", "files": {}, "at": time.time()})
            self.events[f"{name}: actor/"] = time.monotonic()
            time.sleep(self.pause)
            publish.write_bytes(f"{out}/metrics.jsonl", b"")
        publish.publish(out, {"kind": stage, "files": {}, "at": time.time(),
                              "summary": {"mean_score": 0.0, "mean_response_length": 0.0}})
        self.events[name][1] = time.monotonic()
        return StageResult(0)

    def stop_all(self):
        pass


def _schedule(spec_path: str, concurrency: int) -> tuple[_PublishingExecutor, dict]:
    from llamarl.pipeline.run import _run_nodes

    spec = load_spec(spec_path)
    nodes = build_dag(spec)
    executor = _PublishingExecutor(concurrency)
    _run_nodes(spec, nodes, {n.name: n for n in nodes}, executor, echo=lambda m: None)
    return executor, {n.name: n for n in nodes}


def test_rollout_k_plus_1_starts_once_ppo_k_published_its_actor(tmp_path):
    from llamarl.pipeline.records import node_key, read_record

    spec = _spec(tmp_path, 0, iterations=2, executor={"kind": "local", "options": {"max_concurrent_stages": 2}})
    run = load_spec(spec).run_dir
    # A killed earlier run of ppo 1 left its actor published: never a start for rollout 2.
    publish.prepare(f"{run}/iter-001/ppo", lambda m: False)
    publish.prepare(f"{run}/iter-001/ppo/actor", lambda m: False)
    publish.publish(f"{run}/iter-001/ppo/actor", {"kind": "checkpoint", "files": {}, "at": "the killed run"})
    stale = publish.output_id(f"{run}/iter-001/ppo/actor")
    ex, by = _schedule(spec, 2)
    ev = ex.events
    # rollout 2 and export: once ppo's actor/ is published, before its stage ends; ppo 2 (which
    # reads ppo 1's training state) and everything else only after their inputs end.
    assert ev["iter-001/ppo: actor/"] < ev["iter-002/rollout"][0] < ev["iter-001/ppo"][1]
    assert ev["iter-002/ppo: actor/"] < ev["export"][0] < ev["iter-002/ppo"][1]
    assert ev["iter-002/ppo"][0] >= ev["iter-001/ppo"][1] and ev["iter-002/scores"][0] >= ev["iter-002/rollout"][1]
    records = {n: read_record(run, by[n]) for n in by}
    assert records["iter-002/rollout"]["started"] < records["iter-001/ppo"]["finished"]  # also in the records
    # rollout 2's key names the actor it read, this run's, not the killed run's.
    fresh = publish.output_id(f"{run}/iter-001/ppo/actor")
    assert fresh != stale and records["iter-002/rollout"]["key"] == node_key(by["iter-002/rollout"], by)
    assert all(r["status"] == "done" and r["key"] == node_key(by[n], by) for n, r in records.items())
    # ppo 1's whole output is no input of rollout 2: its key moves with the actor alone.
    m = publish.read_manifest(f"{run}/iter-001/ppo")
    publish.publish(f"{run}/iter-001/ppo", {**m, "note": "another metrics file"})
    assert node_key(by["iter-002/rollout"], by) == records["iter-002/rollout"]["key"]
    assert node_key(by["iter-002/ppo"], by) != records["iter-002/ppo"]["key"]
    # A ppo left unfinished (killed after its weights): what read them early is not done, since
    # that ppo's rerun writes them again.
    from llamarl.pipeline.records import assess

    os.remove(f"{run}/iter-001/ppo/{publish.MANIFEST}")
    assert assess(run, by["iter-002/rollout"], by, set()) == (
        False, "iter-001/ppo is unfinished: its actor/ will be written again")


def test_the_executor_hears_of_each_stage_that_comes_next_while_others_run(tmp_path):
    """``Executor.prepare``: once a stage's inputs are done, running, or themselves next, the
    executor is told, once, while its inputs still run (resident workers get ready meanwhile)."""
    ex, by = _schedule(_spec(tmp_path, 0, iterations=2), 2)
    ev = ex.events
    assert set(ex.prepared) <= set(by)
    # ppo 1 reads rollout 1 and its scores: it is next once rollout 1 starts, before the scores do.
    assert ev["shard/actor"][1] < ex.prepared["iter-001/ppo"] < ev["iter-001/rollout"][1]
    assert ev["iter-001/ppo: actor/"] < ex.prepared["iter-002/ppo"] < ev["iter-002/ppo"][0]
    assert all(ex.prepared[n] < ev[n][0] for n in ex.prepared)


def test_the_driver_looks_for_a_part_of_a_running_stage_five_times_a_second(tmp_path):
    from llamarl.pipeline import schedule as schedule_module

    spec = load_spec(_spec(tmp_path, 0, iterations=2))
    nodes = build_dag(spec)
    by = {n.name: n for n in nodes}
    sched = schedule_module.Schedule(spec, nodes, by, _PublishingExecutor(2), echo=lambda m: None)
    sched.waiting = [n for n in nodes if n.name not in ("iter-001/ppo",)]
    sched.running = {"ppo": by["iter-001/ppo"]}  # rollout 2 may start from its actor/
    assert sched.poll_s() == schedule_module.PART_POLL_S == 0.2
    sched.running = {"rollout": by["iter-001/rollout"]}  # nothing waits on a part of it
    assert sched.poll_s() == 1.0
    sched.running = {"ppo": by["iter-001/ppo"], "other": by["iter-001/rollout"]}  # no room for another
    assert sched.poll_s() == 1.0
    # A stand-in run: rollout 2 starts within a poll of ppo 1's actor/ (before: up to a second).
    ev = _schedule(_spec(tmp_path, 0, iterations=2), 2)[0].events
    assert 0 <= ev["iter-002/rollout"][0] - ev["iter-001/ppo: actor/"] < 0.5


def test_one_stage_at_a_time_keeps_the_order(tmp_path):
    spec = _spec(tmp_path, 0, iterations=2)
    ex, by = _schedule(spec, 1)
    order = sorted((n for n in ex.events if ":" not in n), key=lambda n: ex.events[n][0])
    assert order == [n.name for n in build_dag(load_spec(spec))]
    spans = [ex.events[n] for n in order]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one at a time: rollout 2 after ppo 1 ends


def test_a_stage_starts_after_retention_and_before_the_metrics_of_the_one_that_made_it_ready(tmp_path, monkeypatch):
    # Retention's deletions come first (the next stage's free-space check counts on them); the
    # metrics and their plot (a second or so) are written behind, in a thread, in the order stages
    # end: the next stage starts without waiting for them.
    from llamarl.pipeline import schedule as schedule_module

    real_metrics, real_retire = schedule_module.update_metrics_after, schedule_module.retire_done
    metrics, retired = {}, []

    def slow_metrics(spec, n, monitor):
        start = time.monotonic()
        if n.stage == "ppo":
            time.sleep(1.0)
        real_metrics(spec, n, monitor)
        metrics[n.name] = (start, time.monotonic())

    def retire(*args):
        retired.append(time.monotonic())
        return real_retire(*args)

    monkeypatch.setattr(schedule_module, "update_metrics_after", slow_metrics)
    monkeypatch.setattr(schedule_module, "retire_done", retire)
    ex, by = _schedule(_spec(tmp_path, 0, iterations=2), 1)
    ev = ex.events
    ppo1 = metrics["iter-001/ppo"]
    assert ev["iter-001/ppo"][1] <= ppo1[0] and ev["iter-002/rollout"][0] < ppo1[1]
    # rollout 2 ends at once; the scores it made ready start while ppo 1's metrics are still written.
    assert ev["iter-002/scores"][0] < ppo1[1]
    assert any(ev["iter-001/ppo"][1] < t < ev["iter-002/rollout"][0] for t in retired)
    assert set(metrics) == set(by) and ppo1[1] <= metrics["iter-002/ppo"][0]


def test_two_stages_at_once_by_default_where_there_are_gpus(monkeypatch):
    from llamarl.cluster import local

    monkeypatch.setattr(local.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local.LocalExecutor().concurrency == 2
    assert local.LocalExecutor(local.LocalOptions(max_concurrent_stages=1)).concurrency == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local.LocalExecutor().concurrency == 1
    monkeypatch.setattr(local.os.path, "exists", lambda p: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local.LocalExecutor().concurrency == 1  # CPU only: each stage's processes take the cores


@pytest.mark.slow
def test_the_demo_with_two_stages_at_once_starts_rollout_k_plus_1_before_ppo_k_ends(tmp_path):
    # Sequential iterations (max_staleness 0); each ppo held 3 s while it writes its training state
    # (the slow write of a real model), after its weights are published.
    spec = _spec(tmp_path, 0, iterations=2, executor={"kind": "local", "options": {"max_concurrent_stages": 2}})
    env = {**os.environ, "LLAMARL_TEST_PPO_AT": "published train_state/actor:sleep=3"}
    proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True, text=True,
                          timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = load_spec(spec).run_dir
    records = {f.removesuffix(".json"): json.load(open(os.path.join(run_dir, "pipeline", f)))
               for f in os.listdir(os.path.join(run_dir, "pipeline")) if f.endswith(".json") and f != "lock.json"}
    assert records["iter-002.rollout"]["started"] < records["iter-001.ppo"]["finished"], records
    assert records["export"]["started"] < records["iter-002.ppo"]["finished"], records
    assert records["iter-002.ppo"]["started"] >= records["iter-001.ppo"]["finished"]
    said = " ".join(proc.stdout.split())  # the console wraps long lines
    assert ("[iter-002/rollout] running rollout on 2 process(es): not run before; iter-001/ppo/actor published "
            "(beside iter-001/ppo)") in said, proc.stdout
    sampled = publish.read_manifest(os.path.join(run_dir, "iter-002", "rollout"))["request"]["actor_id"]
    assert sampled == publish.output_id(os.path.join(run_dir, "iter-001", "ppo", "actor"))
    # Nothing left to do: the keys recorded are those of what each stage read.
    again = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "running" not in again.stdout, again.stdout[-3000:]
