"""Resident stage workers (cluster/resident.py, cluster/worker.py): a run whose stages are calls in
long-lived workers publishes what a run of a process per stage publishes; a worker killed
mid-stage fails its stage, and `llamarl run` again finishes with the same bytes; a user error is
the stage's one line and status 2; a stopped run leaves no worker behind.

Every run here is the same 3-iteration spec on a tiny toy model, at the same path (a rollout's
parts name the actor they sampled from), with shard, rollout and ppo on 2 ranks, score on 2 and
export on 1: a stage on fewer ranks than there are workers runs on the first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import ClassVar

import pytest
import yaml

from driver import ENV, alive, start
from llamarl.cluster.executor import StageResult
from llamarl.cluster.kinds import make_executor
from llamarl.cluster.local import LocalExecutor, LocalOptions, survivors
from llamarl.cluster.resident import POOL, ResidentExecutor
from llamarl.lib.errors import EXIT_USER_ERROR
from llamarl.lib.files import publish
from llamarl.pipeline import toy
from llamarl.pipeline.dag import load_spec
from llamarl.pipeline.run import run_spec
from llamarl.stages.config import ExportConfig, ShardConfig

LAYOUT = {"shard": {"tp": 2}, "rollout": {"tp": 2}, "score": {"dp": 2}, "ppo": {"tp": 2}, "export": {"procs": 1}}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """``make(resident, **options)``: the spec of the module's run, its run directory emptied (every
    run is at the same path); (spec path, run directory)."""
    root = tmp_path_factory.mktemp("resident")
    toy.make_llama(str(root / "actor"), hidden_size=32)
    toy.make_prompts(str(root / "train.jsonl"), n=16)

    def make(resident: bool, **options) -> tuple[str, str]:
        data = {"name": "toy", "storage": str(root / "runs"), "actor": str(root / "actor"),
                "prompts": str(root / "train.jsonl"), "prompts_per_iteration": 8, "seed": 7, "iterations": 3,
                "rollout": {"id_column": "id", "chunk_size": 4,
                            "sampling": {"samples_per_prompt": 2, "max_new_tokens": 4}},
                "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]},
                "ppo": {"advantage": "grpo", "mini_batch_size": 16, "actor_lr": 0.01},
                "layout": LAYOUT, "executor": {"kind": "local", "options": {"resident": resident, **options}}}
        shutil.rmtree(root / "runs", ignore_errors=True)
        path = root / "spec.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path), str(root / "runs" / "toy")

    return make


def published(run: str) -> dict:
    """Every file each manifest of ``run`` publishes, by path: its size and checksum — except a
    rollout part, which names the actor's output id (its manifest's, made afresh by each run):
    compared row by row with its other metadata."""
    import pyarrow.parquet as pq

    found = {}
    for folder, _, names in os.walk(run):
        if publish.MANIFEST not in names:
            continue
        manifest = json.load(open(os.path.join(folder, publish.MANIFEST)))
        for name, entry in manifest.get("files", {}).items():
            path = os.path.join(folder, name)
            if name.endswith(".parquet"):
                table = pq.read_table(path)
                meta = {k: v for k, v in (table.schema.metadata or {}).items() if not k.endswith(b"_id")}
                entry = (table.to_pylist(), meta)
            found[os.path.relpath(path, run)] = entry
    return found


@pytest.fixture(scope="module")
def reference(toy_run):
    """What the run publishes with a process per stage, and how long it took."""
    spec, run = toy_run(resident=False)
    start = time.monotonic()
    run_spec(load_spec(spec), echo=lambda m: None)
    return published(run), time.monotonic() - start


class _Watched(ResidentExecutor):
    """Records the workers' pids of each stage it runs, by rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pids: dict[str, list[int]] = {}

    def submit(self, stage, config, nprocs, nodes=1, *, name=None):
        run = super().submit(stage, config, nprocs, nodes, name=name)
        self.pids[run.name] = [p.pid for p in run.procs]
        return run


@pytest.mark.slow
def test_a_resident_run_publishes_the_bytes_of_a_process_per_stage(toy_run, reference):
    expected, process_wall = reference
    spec, run = toy_run(resident=True)
    loaded = load_spec(spec)
    executor = _Watched(make_executor("local", loaded.executor.options, run, "x").options)
    start = time.monotonic()
    run_spec(loaded, echo=lambda m: None, executor=executor)
    wall = time.monotonic() - start
    assert published(run) == expected
    # One worker per rank for the whole run: every stage's rank r ran in the same process, export's
    # one rank in rank 0's; and once the run is over no worker lives.
    ranks = {tuple(pids) for name, pids in executor.pids.items() if name != "export"}
    assert len(ranks) == 1 and len(next(iter(ranks))) == 2, executor.pids
    assert executor.pids["export"] == [next(iter(ranks))[0]]
    assert survivors([(pid, None) for pid in next(iter(ranks))]) == {}
    # ppo 2 started from what ppo 1 left in the same workers (stages/ppo_kept.py), at TP 2, and
    # published the bytes of a ppo that read its files.
    summaries = [publish.read_manifest(f"{run}/iter-00{i}/ppo")["summary"] for i in (1, 2, 3)]
    assert [s["models_from"] for s in summaries] == ["files", "memory", "memory"]
    # The reference: none in ppo 1 (the rollout's log-probs are its own), read by ppo 2, kept for 3.
    assert [s["reference_from"] for s in summaries] == [None, "files", "memory"]
    print(f"3-iteration toy run: resident {wall:.1f}s, a process per stage {process_wall:.1f}s")


def _cli(*args, env=ENV, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _registered(run: str, name: str, driver: subprocess.Popen) -> dict[str, list[int]]:
    """Once the run's lock lists ``name`` among its processes: every registered name's pids."""
    lock = os.path.join(run, "pipeline", "lock.json")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert driver.poll() is None, driver.communicate()[0]
        try:
            stages = json.load(open(lock))["stages"]
        except (OSError, ValueError, KeyError):
            stages = {}
        if name in stages:
            return {n: [pid for pid, _ in s["procs"]] for n, s in stages.items()}
        time.sleep(0.02)
    raise AssertionError(f"{name} never ran")


@pytest.mark.slow
def test_a_worker_killed_mid_stage_fails_it_and_the_next_run_ends_with_the_same_bytes(toy_run, reference):
    spec, run = toy_run(resident=True, grace_s=1)
    # ppo's ranks wait at their first step, so that the kill lands inside the stage.
    driver = start(spec, env={**ENV, "LLAMARL_TEST_PPO_AT": "step 1:sleep=60"})
    procs = _registered(run, "iter-001/ppo", driver)
    time.sleep(2)
    os.kill(procs["iter-001/ppo"][1], signal.SIGKILL)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == EXIT_USER_ERROR, out
    assert out.strip().splitlines()[-1].startswith("error: stage iter-001/ppo failed ("), out
    assert not [pid for pids in procs.values() for pid in pids if alive(pid)], "no worker outlives its run"
    assert not os.path.exists(os.path.join(run, "pipeline", "lock.json"))
    rerun = _cli("run", spec)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "[iter-001/ppo] running ppo" in rerun.stdout and "[iter-001/rollout] done, skipped" in rerun.stdout
    assert published(run) == reference[0]


@pytest.mark.slow
def test_sigterm_stops_the_run_and_every_worker(toy_run):
    spec, run = toy_run(resident=True)
    driver = start(spec, env={**ENV, "LLAMARL_TEST_PPO_AT": "step 1:sleep=60"})  # a stage that is still running
    procs = _registered(run, "iter-001/ppo", driver)
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == 128 + signal.SIGTERM, out
    assert out.strip().splitlines()[-1] == (f"error: llamarl run got SIGTERM: stopped iter-001/ppo, every "
                                            f"process of each; rerun `llamarl run {spec}` to resume")
    assert "Traceback" not in out
    assert len(procs[POOL]) == 2 and not [pid for pids in procs.values() for pid in pids if alive(pid)]
    assert not os.path.exists(os.path.join(run, "pipeline", "lock.json"))


def _shard(tmp_path) -> ShardConfig:
    return ShardConfig(src=str(tmp_path / "no-such-model"), dst=str(tmp_path / "out"), tp=2)


def test_a_user_error_in_a_worker_is_the_stages_one_line_and_status_2(tmp_path, capfd):
    expected = LocalExecutor().run("shard", _shard(tmp_path), nprocs=2)
    assert expected == StageResult(EXIT_USER_ERROR, f"{tmp_path}/no-such-model/config.json not found; point SRC at "
                                                    f"an HF checkpoint directory")
    executor = _Watched(LocalOptions(resident=True))
    try:
        assert executor.run("shard", _shard(tmp_path), nprocs=2, name="first") == expected
        # The workers stay after a user error, and serve the next stage; a stage of one runs on the first.
        assert executor.run("shard", _shard(tmp_path), nprocs=1, name="second") == expected
    finally:
        executor.close()
    assert executor.pids["second"] == executor.pids["first"][:1]
    assert survivors([(pid, None) for pid in executor.pids["first"]]) == {}
    err = capfd.readouterr().err
    assert err.count(f"error: {expected.error}\n") == 3 and "Traceback" not in err  # once a stage, as before
    assert "\x1f" not in err  # the workers' own lines stay between them and the executor


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if b"=" in v)


def test_with_gpus_each_worker_sees_its_own_gpu_for_life(tmp_path):
    executor = _Watched(LocalOptions(resident=True, gpus=3))
    try:
        assert executor.run("shard", _shard(tmp_path), nprocs=2, name="two").code == EXIT_USER_ERROR
        assert executor.run("shard", _shard(tmp_path), nprocs=1, name="one").code == EXIT_USER_ERROR
        workers = {pid: _environ(pid)["CUDA_VISIBLE_DEVICES"] for pid in executor.pids["two"]}
    finally:
        executor.close()
    assert list(workers.values()) == ["0", "1"] and executor.pids["one"] == executor.pids["two"][:1]


def test_beside_a_running_stage_the_next_takes_spare_workers_started_with_the_first(tmp_path):
    """With stages beside each other, the workers of a second stage are started (and import the
    iteration's stages) while the first runs: a rollout that starts beside a ppo does not begin
    with a worker's imports."""
    executor = _Watched(LocalOptions(max_concurrent_stages=2))
    try:
        first = executor.submit("shard", _shard(tmp_path), 2, name="first")
        started = {w.proc.pid for w in executor._workers.values()}
        second = executor.submit("shard", _shard(tmp_path), 2, name="second")  # ``first`` holds its workers
        assert executor.wait(second).code == executor.wait(first).code == EXIT_USER_ERROR
    finally:
        executor.close()
    assert len(started) == 4 and set(executor.pids["second"]) == started - set(executor.pids["first"])
    assert survivors([(pid, None) for pid in started]) == {}


class _Ready(ExportConfig):
    prepares: ClassVar[bool] = True  # as if export had something to get ready (ppo's compiling)


def test_a_stage_runs_on_the_workers_that_got_ready_for_it_and_each_kind_keeps_its_own(tmp_path):
    """``prepare`` (the pipeline's word that a stage comes next) readies a spare beside the running
    stage; the stage then runs there, and later runs of each kind go back to the worker that ran it
    last (what it compiled stays warm), not to the lowest free one."""
    export = _Ready(src=str(tmp_path / "no-such-checkpoint"), dst=str(tmp_path / "hf"))
    executor = _Watched(LocalOptions(max_concurrent_stages=2))
    try:
        first = executor.submit("shard", _shard(tmp_path), 1, name="shard-1")
        executor.prepare("export", export, 1, name="export-1")
        ready = {w.slot: w.proc.pid for w in executor._workers.values()}
        assert executor.wait(first).code == EXIT_USER_ERROR
        for name in ("export-1", "shard-2", "export-2"):
            stage, config = (("export", export) if name.startswith("export") else ("shard", _shard(tmp_path)))
            assert executor.run(stage, config, 1, name=name).code == EXIT_USER_ERROR
        executor.prepare("export", export, 1, name="export-3")  # one ran it already: nothing to do
        executor.prepare("shard", _shard(tmp_path), 1, name="shard-3")  # nothing to get ready for a shard
        assert sorted(executor._workers) == [0, 1]
    finally:
        executor.close()
    assert sorted(ready) == [0, 1]
    assert executor.pids["shard-1"] == executor.pids["shard-2"] == [ready[0]]
    assert executor.pids["export-1"] == executor.pids["export-2"] == [ready[1]]


def test_a_stage_goes_back_to_the_workers_of_its_last_run_rank_by_rank(tmp_path):
    """What a stage leaves in memory for its next run is a rank's (ppo's training state, which a
    ppo with retention.train_state_every never writes): rank r runs where rank r ran last, not on
    the lowest free worker that ran the stage."""
    export = _Ready(src=str(tmp_path / "no-such-checkpoint"), dst=str(tmp_path / "hf"))
    executor = _Watched(LocalOptions(max_concurrent_stages=2))
    try:
        assert executor.run("shard", _shard(tmp_path), 3, name="three").code == EXIT_USER_ERROR
        pids = {w.slot: w.proc.pid for w in executor._workers.values()}
        executor._busy.add(1)
        assert executor.run("export", export, 2, name="export-1").code == EXIT_USER_ERROR  # on slots 0 and 2
        executor._busy.discard(1)
        assert executor._last["export"] == [0, 2]
        executor._last["export"] = [2, 0]  # as a run that took slot 2 first
        assert executor.run("export", export, 2, name="export-2").code == EXIT_USER_ERROR
    finally:
        executor.close()
    assert executor.pids["export-2"] == [pids[2], pids[0]]


def test_a_stage_comes_next_while_every_spare_is_busy_gets_ready_on_a_worker_more(tmp_path):
    """Two stages side by side on every spare (``max_staleness: 1`` starts two rollouts at once):
    the stage that comes next gets ready on a worker of its own, and runs there."""
    export = _Ready(src=str(tmp_path / "no-such-checkpoint"), dst=str(tmp_path / "hf"))
    executor = _Watched(LocalOptions(max_concurrent_stages=2))
    try:
        executor._spares = 2
        executor._busy.update({0, 1})  # as two running one-process stages hold them
        executor.prepare("export", export, 1, name="export-1")
        assert sorted(executor._workers) == [2] and executor._readying == {2: "export"}
        ready = executor._workers[2].proc.pid
        executor._busy.difference_update({0, 1})
        assert executor.run("export", export, 1, name="export-1").code == EXIT_USER_ERROR
    finally:
        executor.close()
    assert executor.pids["export-1"] == [ready]


def test_one_stage_at_a_time_readies_no_worker(tmp_path):
    executor = _Watched(LocalOptions(resident=True, max_concurrent_stages=1))
    try:
        executor.prepare("shard", _shard(tmp_path), 1, name="next")
        assert executor._workers == {}
    finally:
        executor.close()


def test_a_worker_runs_the_stages_prepare_and_a_failed_one_costs_a_note_only(tmp_path, monkeypatch, capsys):
    import types

    from llamarl.cluster import worker
    from llamarl.cluster.executor import stage_args
    from llamarl.stages import config as stage_configs

    seen = []
    probe = types.ModuleType("llamarl.stages._probe")
    probe.prepare = seen.append
    monkeypatch.setitem(sys.modules, "llamarl.stages._probe", probe)
    monkeypatch.setitem(stage_configs.STAGES, "_probe", ShardConfig)
    request = {"stage": "_probe", "argv": stage_args("shard", _shard(tmp_path))[2:], "env": dict(os.environ)}
    worker.prepare(request)
    assert seen == [_shard(tmp_path)]
    probe.prepare = lambda config: 1 / 0
    worker.prepare(request)
    assert "note: getting _probe ready failed (ZeroDivisionError: division by zero)" in capsys.readouterr().err
