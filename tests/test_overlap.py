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

from llamarl.lib import publish
from llamarl.pipeline import demo
from llamarl.pipeline.run import build_dag, run_spec
from llamarl.pipeline.spec import load_spec


def _spec(tmp_path, staleness: int, **changes) -> str:
    path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(path))
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
