"""The pipeline: the demo spec end to end, resume rules, dry-run, status, kill-and-rerun."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from safetensors.torch import load_file

from llamarl.lib.files import publish
from llamarl.pipeline import demo
from llamarl.pipeline.dag import load_spec

pytestmark = pytest.mark.slow


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True, text=True,
                          timeout=900, **kw)


def _records(run_dir) -> dict[str, dict]:
    d = os.path.join(run_dir, "pipeline")
    return {f: json.load(open(os.path.join(d, f))) for f in os.listdir(d) if f.endswith(".json")}


def rerun_redoing_nothing_finished(spec: str, run_dir: str) -> None:
    """`llamarl run SPEC` again after a kill: it ends well, and every stage finished before keeps
    its record (finish time, output id): none was redone."""
    finished_before = {k: v for k, v in _records(run_dir).items() if v.get("status") == "done"}
    rerun = _cli("run", spec)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    after = _records(run_dir)
    for name, record in finished_before.items():
        assert after[name]["finished"] == record["finished"] and after[name]["output_id"] == record["output_id"], name


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    spec = demo.make_inputs(str(root))
    proc = _cli("run", spec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return spec, load_spec(spec).run_dir, proc.stdout


def test_demo_runs_every_stage_and_the_score_rises(demo_run):
    spec, run_dir, stdout = demo_run
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[-1]["mean_score"] > rows[0]["mean_score"], rows
    assert open(os.path.join(run_dir, "metrics.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "mean score" in stdout
    # One stage at a time (the local executor's default): in the DAG's order, none started early.
    from llamarl.pipeline.dag import build_dag

    assert re.findall(r"^\[([\w/-]+)\] running", stdout, re.M) == [n.name for n in build_dag(load_spec(spec))]
    assert "beside" not in stdout and "/actor published" not in stdout
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "export"))
    assert publish.require_published(os.path.join(run_dir, "export"), "hf_export")


def test_rerun_redoes_nothing(demo_run):
    spec, run_dir, _ = demo_run
    before = _records(run_dir)
    proc = _cli("run", spec)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("done, skipped") == 18 and "running" not in proc.stdout
    assert _records(run_dir) == before


def test_flipping_placement_options_reruns_nothing(demo_run, tmp_path):
    # Placement says how a stage runs, not what it computes: a finished run stays finished.
    spec, run_dir, _ = demo_run
    before = _records(run_dir)
    data = yaml.safe_load(open(spec))
    data["score"]["offload"] = not data["score"].get("offload", True)
    data["export"]["verify"] = not data["export"].get("verify", True)
    for stage in ("rollout", "score", "ppo", "export"):
        data[stage]["collective_timeout_s"] = 123
    flipped = tmp_path / "flipped.yaml"
    flipped.write_text(yaml.safe_dump(data))
    proc = _cli("run", str(flipped))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("done, skipped") == 18 and "running" not in proc.stdout, proc.stdout
    assert _records(run_dir) == before


def test_a_ppo_missing_a_part_is_not_done(demo_run, tmp_path):
    """A damaged checkpoint's error says "delete …/iter-002/ppo/actor and rerun the stage that
    wrote it": with its actor/ gone, that ppo is neither done nor found made elsewhere."""
    from llamarl.pipeline.dag import build_dag
    from llamarl.pipeline.records import plan, published_current

    spec, run_dir, _ = demo_run
    nodes = build_dag(load_spec(spec))
    by_name = {n.name: n for n in nodes}
    actor = os.path.join(run_dir, "iter-002", "ppo", "actor")
    os.rename(actor, tmp_path / "actor")
    try:
        assert plan(run_dir, nodes, by_name)["iter-002/ppo"] == (False, "its actor/ is missing, or not the one it "
                                                                        "published")
        assert not published_current(by_name["iter-002/ppo"])
    finally:
        os.rename(tmp_path / "actor", actor)
    assert plan(run_dir, nodes, by_name)["iter-002/ppo"][0] and published_current(by_name["iter-002/ppo"])


def test_status_and_dry_run_after_a_config_change(demo_run, tmp_path):
    spec, run_dir, _ = demo_run
    status = _cli("status", run_dir)
    assert status.returncode == 0 and status.stdout.count(" done ") >= 18, status.stdout
    assert "no `llamarl run` holds this run now" in status.stdout
    data = yaml.safe_load(open(spec))
    data["ppo"]["actor_lr"] = 0.02
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(data))
    plan = _cli("run", str(changed), "--dry-run")
    assert plan.returncode == 0, plan.stderr
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in plan.stdout.splitlines() if line.count("│") >= 3}
    assert lines["iter-001/scores"].startswith("skip") and lines["iter-001/rollout"].startswith("skip")
    assert lines["iter-001/ppo"] == "run: its config or inputs changed"
    assert lines["iter-002/rollout"].startswith("run: an input will be redone") and lines["export"].startswith("run")
    assert _cli("status", str(tmp_path / "nope")).returncode == 2


def test_bad_spec_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstorage: /tmp\nactor: a\nprompts: p\nitertions: 3\n")
    proc = _cli("run", str(bad))
    assert proc.returncode == 2
    assert "bad.yaml: itertions: unknown option; valid options: name, storage" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr


def test_killed_at_a_random_point_then_rerun_gives_the_same_export(demo_run, tmp_path):
    spec, run_dir, _ = demo_run
    data = yaml.safe_load(open(spec))
    data["storage"] = str(tmp_path / "runs")
    killed_spec = tmp_path / "killed.yaml"
    killed_spec.write_text(yaml.safe_dump(data))
    killed_dir = load_spec(str(killed_spec)).run_dir
    delay = random.Random().uniform(8, 70)
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(killed_spec)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun_redoing_nothing_finished(str(killed_spec), killed_dir)
    a = load_file(os.path.join(run_dir, "export", "model.safetensors"))
    b = load_file(os.path.join(killed_dir, "export", "model.safetensors"))
    assert sorted(a) == sorted(b) and all((a[k] == b[k]).all() for k in a), f"killed after {delay:.0f}s"
