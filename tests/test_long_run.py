"""A long run: a prompt dataset consumed over iterations, every iteration its own seed, validation,
retention, TensorBoard — and resuming, rerunning and extending it.

One run of 6 iterations over 48 prompts, 16 an iteration, validated every 2 iterations, keeping the
last iteration whole (and the actor of iteration 4), is made once
in the test's process pool (the stages' own ``run``, without a process start each) and inspected;
the same spec run as `llamarl run` processes, killed at a random point and run again, must end with
the same bytes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import yaml
from pool_executor import PoolExecutor

from llamarl.lib.files import publish
from llamarl.pipeline import toy
from llamarl.pipeline.dag import load_spec
from llamarl.pipeline.run import run_spec
from llamarl.stages import contract

pytestmark = pytest.mark.slow

ITERATIONS, PROMPTS, PER_ITERATION = 6, 48, 16


def _inputs(root) -> dict:
    toy.make_llama(str(root / "actor"), hidden_size=32)
    toy.make_prompts(str(root / "train.jsonl"), n=PROMPTS)
    toy.make_prompts(str(root / "val.jsonl"), n=4, first=500, id_prefix="v")
    return {"name": "long", "storage": str(root / "runs"), "actor": str(root / "actor"),
            "prompts": str(root / "train.jsonl"), "prompts_per_iteration": PER_ITERATION, "seed": 7,
            "iterations": ITERATIONS,
            "validation": {"prompts": str(root / "val.jsonl"), "every": 2, "sampling": {"samples_per_prompt": 2}},
            "retention": {"keep_last": 1, "keep_every": 4},
            "metrics": {"tensorboard": str(root / "tb")},
            "rollout": {"id_column": "id", "chunk_size": 8,
                        "sampling": {"samples_per_prompt": 2, "max_new_tokens": 4}},
            "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]},
            "ppo": {"advantage": "grpo", "mini_batch_size": 16, "actor_lr": 0.01}}


def _write(root, data: dict, name: str = "spec.yaml") -> str:
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, pool1):
    root = tmp_path_factory.mktemp("long")
    data = _inputs(root)
    spec = load_spec(_write(root, data))
    executor = PoolExecutor(pool1)
    run_spec(spec, echo=lambda m: None, executor=executor)
    run = spec.run_dir
    made = {"taken": {i: _prompt_ids(f"{run}/iter-{i:03d}/rollout") for i in range(1, ITERATIONS + 1)},
            "metrics": open(f"{run}/metrics.jsonl").read(),
            "export": {name: open(f"{run}/export/{name}", "rb").read() for name in os.listdir(f"{run}/export")
                       if name != publish.MANIFEST}}  # as they are before the tests below extend the run
    return root, data, spec, executor, made


def _prompt_ids(rollout: str) -> list[str]:
    """The prompt ids a rollout took, in its order (each once: its first sample's row)."""
    rows = contract.read_rows(rollout, publish.require_published(rollout, contract.ROLLOUT))
    return [r[contract.PROMPT_ID] for r in rows if r[contract.SAMPLE_INDEX] == 0]


def test_iterations_take_the_dataset_epoch_by_epoch_each_with_its_own_seed(long_run):
    _, _, spec, _, by_iteration = long_run
    run = spec.run_dir
    taken = [by_iteration["taken"][i] for i in range(1, ITERATIONS + 1)]
    assert all(len(t) == PER_ITERATION for t in taken)
    every = sorted(f"p{i:04d}" for i in range(PROMPTS))
    first, second = taken[0] + taken[1] + taken[2], taken[3] + taken[4] + taken[5]
    assert sorted(first) == every and sorted(second) == every  # each epoch: every prompt once
    assert first != second  # in another order
    seeds = [publish.read_manifest(f"{run}/iter-{i:03d}/rollout")["request"]["config"]["sampling"]["seed"]
             for i in range(1, ITERATIONS + 1)]
    assert len(set(seeds)) == ITERATIONS


def test_validation_rows_at_exactly_the_validated_iterations(long_run):
    _, _, spec, _, _ = long_run
    rows = [json.loads(line) for line in open(f"{spec.run_dir}/metrics.jsonl")]
    assert [r["iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
    assert [r["iteration"] for r in rows if "val_score" in r] == [2, 4, 6]
    validated = rows[1]
    assert validated["val_samples"] == 2 and validated["val_prompts"] == 4
    assert {"val_best@2", "val_pass@1", "val_pass@2", "val_score_llamarl.pipeline.demo:vowel_ratio"} <= set(validated)
    assert 0 <= validated["val_pass@1"] <= validated["val_pass@2"] <= 1


def test_validation_counted_at_another_pass_threshold_is_counted_again(long_run):
    from llamarl.pipeline.metrics import iteration_metrics

    _, _, spec, _, _ = long_run
    rows = [json.loads(line) for line in open(f"{spec.run_dir}/metrics.jsonl")]
    assert {r["val_pass_threshold"] for r in rows if "val_score" in r} == {1.0}  # the spec's default
    lenient = [r for r in iteration_metrics(spec.run_dir, ITERATIONS, pass_threshold=0.0) if "val_score" in r]
    # Every score is at least 0: at 0 every sample passes (the scores are there to count again).
    assert [(r["val_pass_threshold"], r["val_pass@1"], r["val_pass@2"]) for r in lenient] == [(0.0, 1.0, 1.0)] * 3


def test_retention_keeps_one_training_state_and_the_kept_actors(long_run):
    _, _, spec, _, _ = long_run
    run = spec.run_dir
    states = sorted(os.path.relpath(d, run) for d, _, files in os.walk(run)
                    if "train_state" in d and any(f.endswith(".distcp") for f in files))
    assert states == ["iter-006/ppo/train_state/actor/optim"], states
    actors = sorted(i for i in range(1, ITERATIONS + 1) if os.path.exists(f"{run}/iter-{i:03d}/ppo/actor/model"))
    assert actors == [4, 6]  # keep_every 4, and the last
    with pytest.raises(Exception, match="deleted by its run's retention"):
        publish.require_published(f"{run}/iter-002/ppo/actor", contract.CHECKPOINT)


def test_tensorboard_holds_the_metrics_rows(long_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _, spec, _, _ = long_run
    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    rows = [json.loads(line) for line in open(f"{spec.run_dir}/metrics.jsonl")]
    assert [e.step for e in events.Scalars("train/mean_score")] == list(range(1, ITERATIONS + 1))
    assert [round(e.value, 5) for e in events.Scalars("train/mean_score")] == [round(r["mean_score"], 5) for r in rows]
    assert [e.step for e in events.Scalars("val/score")] == [2, 4, 6]


def test_status_says_epoch_position_and_what_was_deleted(long_run):
    from llamarl.pipeline.status import status

    _, _, spec, _, _ = long_run
    why = {name: why for name, _, why in status(spec.run_dir)}
    assert "epoch 1, prompts 17–32 of 48" in why["iter-002/rollout"]
    assert "epoch 2, prompts 1–16 of 48" in why["iter-004/rollout"]
    assert "deleted by retention: actor/, train_state/actor/" in why["iter-002/ppo"], why["iter-002/ppo"]
    assert "deleted by retention" not in why["iter-006/ppo"]


def test_a_rerun_runs_nothing_and_more_iterations_run_only_the_new_ones(long_run, pool1):
    root, data, spec, executor, _ = long_run
    executor.ran.clear()
    report = run_spec(spec, echo=lambda m: None, executor=executor)
    assert executor.ran == [] and all(what == "skipped (done)" for _, what in report), report
    # One more iteration, and from now on no samples kept (retention is no stage's config: nothing reruns).
    retention = data["retention"] | {"keep_samples": False}
    longer = load_spec(_write(root, data | {"iterations": ITERATIONS + 1, "retention": retention}, "longer.yaml"))
    run_spec(longer, echo=lambda m: None, executor=executor)
    # Rules only: each rollout publishes its scores, and no score stage starts.
    assert executor.ran == ["iter-007/rollout", "iter-007/ppo", "iter-007/val-rollout", "export"], executor.ran
    run = spec.run_dir
    assert publish.read_manifest(f"{run}/iter-007/rollout")["selection"]["epochs"] == [{"epoch": 2, "from": 0, "to": 16}]
    parts = [d for d, _, files in os.walk(run) if any(f.endswith(".parquet") for f in files)]
    assert parts == [], parts  # samples deleted once trained on, validation samples once their metrics are kept
    assert [json.loads(line).get("val_score") is not None for line in open(f"{run}/metrics.jsonl")] == \
        [False, True, False, True, False, True, True]
    # With the validation's scores deleted, a row keeps what it was counted at, and says so.
    from llamarl.pipeline.metrics import iteration_metrics

    kept = [r for r in iteration_metrics(run, ITERATIONS + 1, pass_threshold=0.0) if "val_score" in r]
    assert {r["val_pass_threshold"] for r in kept} == {1.0}


def test_a_new_validation_of_a_deleted_actor_makes_only_that_iteration_again(long_run):
    """Validating every 3 iterations rather than 2 validates iteration 3, whose actor retention
    deleted: iterations 1–3 are made again from what is on disk (the shard), to the same bytes, so
    each keeps its output id, and no later iteration runs again (the run is the 7 of the test above)."""
    from llamarl.pipeline.dag import build_dag
    from llamarl.pipeline.records import read_record

    root, data, spec, executor, _ = long_run
    every3 = data | {"iterations": ITERATIONS + 1, "retention": data["retention"] | {"keep_samples": False},
                     "validation": data["validation"] | {"every": 3}}
    spec3 = load_spec(_write(root, every3, "every3.yaml"))
    training = [n for n in build_dag(spec3) if n.role != "validate"]
    ids = {n.name: read_record(spec.run_dir, n)["output_id"] for n in training}
    planned = dict(run_spec(spec3, dry_run=True, echo=lambda m: None))
    assert planned["iter-003/ppo"] == "run: deleted by retention, and iter-003/val-rollout needs it"
    assert planned["iter-004/ppo"].startswith("run: an input will be redone; skipped if what retention deleted is "
                                              "made again as it was"), planned["iter-004/ppo"]
    said = []
    executor.ran.clear()
    run_spec(spec3, echo=said.append, executor=executor)
    assert executor.ran == ["iter-001/rollout", "iter-001/ppo", "iter-002/rollout", "iter-002/ppo",
                            "iter-003/rollout", "iter-003/ppo", "iter-003/val-rollout"], executor.ran
    assert {n.name: read_record(spec.run_dir, n)["output_id"] for n in training} == ids
    assert "[iter-003/ppo] made again as it was: it keeps its id, and what was made from it stays done" in said
    rows = [json.loads(line) for line in open(f"{spec.run_dir}/metrics.jsonl")]
    assert [r["iteration"] for r in rows if "val_score" in r] == [2, 3, 4, 6, 7]  # 2 and 4 measured those actors


def test_a_changed_config_redoes_what_retention_deleted_back_to_what_is_on_disk(long_run, tmp_path):
    root, data, _, _, _ = long_run
    changed = load_spec(_write(root, data | {"ppo": data["ppo"] | {"actor_lr": 0.02}}, "changed.yaml"))
    plan = dict(run_spec(changed, dry_run=True, echo=lambda m: None))
    # ppo 1 reruns; what it reads and retention deleted (its rollout and scores) runs again first.
    assert plan["shard/actor"].startswith("skip")
    assert plan["iter-001/rollout"] == plan["iter-001/scores"] == "run: deleted by retention, and iter-001/ppo needs it"
    assert plan["iter-001/ppo"] == "run: an input will be redone"


def test_a_changed_prompts_file_is_refused(long_run):
    root, data, _, _, _ = long_run
    before = (root / "train.jsonl").read_bytes()
    with open(root / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": "extra", "prompt": "one more"}) + "\n")
    try:
        with pytest.raises(Exception, match="the prompts changed since this run first took rows of them"):
            run_spec(load_spec(str(root / "spec.yaml")), dry_run=True, echo=lambda m: None)
    finally:
        (root / "train.jsonl").write_bytes(before)


def test_prompts_touched_or_copied_again_are_the_same_prompts(long_run):
    """The prompts' bytes are what the run takes: a new modification time (a copy without -p, a
    checkout) refuses nothing and reruns no rollout, a changed byte is refused; an older llamarl's
    records, whose fingerprints of the prompts hashed their modification times too, still match."""
    from llamarl.pipeline import records
    from llamarl.pipeline.dag import build_dag

    root, _, spec, executor, _ = long_run
    every3 = load_spec(str(root / "every3.yaml"))  # the run as the tests above left it
    prompts = root / "train.jsonl"
    before = prompts.read_bytes()
    os.utime(prompts, (time.time() + 100, time.time() + 100))
    executor.ran.clear()
    report = run_spec(every3, echo=lambda m: None, executor=executor)
    assert executor.ran == [] and all(what == "skipped (done)" for _, what in report), report
    with open(prompts, "a") as f:
        f.write(json.dumps({"id": "extra", "prompt": "one more"}) + "\n")
    try:
        with pytest.raises(Exception, match="the prompts changed since this run first took rows of them"):
            run_spec(every3, dry_run=True, echo=lambda m: None)
    finally:
        prompts.write_bytes(before)
    # As an older llamarl wrote them: the recorded dataset's and every rollout's fingerprint timed.
    by_name = {n.name: n for n in build_dag(every3)}
    recorded = json.loads((root / "runs" / "long" / "pipeline" / "prompts.json").read_text())
    recorded["fingerprint"] = records.fingerprint(str(prompts), checksums=True, timed=True)
    publish.write_bytes(f"{every3.run_dir}/pipeline/prompts.json", json.dumps(recorded).encode())
    for n in by_name.values():
        if n.stage == "rollout":
            records.write_record(every3.run_dir, n, key=records.node_key(n, by_name, timed=True),
                                 external=records.fingerprints(n, timed=True))
    report = run_spec(every3, echo=lambda m: None, executor=executor)
    assert executor.ran == [] and all(what == "skipped (done)" for _, what in report), report


def test_killed_at_a_random_point_then_rerun_gives_the_same_bytes(long_run, tmp_path):
    """The same spec as `llamarl run` processes, killed with everything it started, then run again."""
    root, data, _, _, made = long_run
    spec = _write(tmp_path, data | {"storage": str(tmp_path / "runs"), "metrics": {}})
    delay = random.Random().uniform(5, 60)
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True, text=True,
                           timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    run = load_spec(spec).run_dir
    for i in range(1, ITERATIONS + 1):
        assert _prompt_ids(f"{run}/iter-{i:03d}/rollout") == made["taken"][i]
    assert open(f"{run}/metrics.jsonl").read() == made["metrics"], f"killed after {delay:.0f}s"
    for name, data_ in made["export"].items():
        assert open(f"{run}/export/{name}", "rb").read() == data_, name
