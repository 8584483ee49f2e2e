"""Rule rewards without a score process: when no reward term needs the reward model, the rollout
scores its own output (stages/scoring.py, ``RolloutConfig.scores``) and the pipeline records the
score stage done without starting it. The scores are the score stage's, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from pool_executor import PoolExecutor

from llamarl.lib.files import publish
from llamarl.pipeline import demo, toy
from llamarl.pipeline.dag import build_dag, load_spec
from llamarl.pipeline.run import PipelineError, run_spec
from llamarl.stages import contract, score
from llamarl.stages.config import ScoreConfig

RULES = [{"name": "llamarl.pipeline.demo:vowel_ratio"}, {"name": "rules_for_tests:response_length", "weight": 0.01}]
TESTS = os.path.dirname(__file__)


def _spec(root, name: str, rewards=RULES) -> str:
    if not os.path.exists(root / "actor"):
        toy.make_llama(str(root / "actor"), hidden_size=32)
        toy.make_prompts(str(root / "train.jsonl"), n=8)
        toy.make_prompts(str(root / "val.jsonl"), n=4, first=500, id_prefix="v")
    data = {"name": name, "storage": str(root / "runs"), "actor": str(root / "actor"),
            "prompts": str(root / "train.jsonl"), "seed": 3, "iterations": 2,
            "validation": {"prompts": str(root / "val.jsonl"), "every": 2, "sampling": {"samples_per_prompt": 2}},
            "rollout": {"id_column": "id", "chunk_size": 4, "sampling": {"samples_per_prompt": 2, "max_new_tokens": 4}},
            "score": {"rewards": rewards},
            "ppo": {"advantage": "grpo", "mini_batch_size": 16, "actor_lr": 0.01}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def rules_run(tmp_path_factory, pool1):
    root = tmp_path_factory.mktemp("rules")
    spec = load_spec(_spec(root, "rules"))
    executor, lines = PoolExecutor(pool1), []
    run_spec(spec, echo=lines.append, executor=executor)
    return root, spec, executor.ran, lines


def _files(out: str) -> dict[str, str]:
    """Every part of a published output, by name: its checksum."""
    return {name: publish.checksum(f"{out}/{contract.PARTS}/{name}") for name in contract.published_parts(out)}


def test_a_rules_only_run_starts_no_score_process(rules_run):
    root, spec, ran, lines = rules_run
    assert ran == ["shard/actor", "iter-001/rollout", "iter-001/ppo", "iter-002/rollout", "iter-002/ppo",
                   "iter-002/val-rollout", "export"], ran
    for name in ("iter-001/scores", "iter-002/scores", "iter-002/val-scores"):
        assert f"[{name}] done: scored in the rollout" in lines, lines
        record = json.load(open(f"{spec.run_dir}/pipeline/{name.replace('/', '.')}.json"))
        assert record["status"] == "done" and record["output_id"] == publish.output_id(f"{spec.run_dir}/{name}")
    assert json.loads(open(f"{spec.run_dir}/metrics.jsonl").read().splitlines()[-1]).get("val_score") is not None


def test_the_rollouts_scores_are_the_score_stages_bytes(rules_run, pool1, tmp_path):
    root, spec, _, _ = rules_run
    nodes = {n.name: n for n in build_dag(spec)}
    for name in ("iter-001/scores", "iter-002/scores", "iter-002/val-scores"):
        cfg = nodes[name].make_config()
        other = str(tmp_path / name.replace("/", "-"))
        pool1.run(score.run, ScoreConfig.model_validate(cfg.model_dump() | {"out": other}))
        ours, theirs = publish.read_manifest(cfg.out), publish.read_manifest(other)
        assert ours["request"] == theirs["request"] and sorted(ours) == sorted(theirs), name
        assert ours["files"] == theirs["files"] and ours["terms"] == theirs["terms"] and ours["rows"] == theirs["rows"]
        assert _files(cfg.out) == _files(other) and _files(other), name
        assert ours["stats"] | {"skipped_parts": 0} == theirs["stats"]
        # Their timing is the scoring's own, after the rollout's work: not the rollout process's start.
        assert ours["timing"]["process_start"] >= publish.read_manifest(cfg.rollout)["timing"]["work_end"]


def test_a_rerun_records_nothing_new(rules_run, pool1):
    root, spec, _, _ = rules_run
    before = {f: open(f"{spec.run_dir}/pipeline/{f}").read() for f in os.listdir(f"{spec.run_dir}/pipeline")
              if f.endswith(".json")}
    executor = PoolExecutor(pool1)
    report = run_spec(spec, echo=lambda m: None, executor=executor)
    assert executor.ran == [] and all(what == "skipped (done)" for _, what in report), report
    for f, text in before.items():
        assert open(f"{spec.run_dir}/pipeline/{f}").read() == text, f


def test_a_failing_rule_fails_the_rollout_in_the_score_stages_words(tmp_path, pool1):
    spec = load_spec(_spec(tmp_path, "failing", rewards=[{"name": "rules_for_tests:raises"}]))
    with pytest.raises(PipelineError) as e:
        run_spec(spec, echo=lambda m: None, executor=PoolExecutor(pool1))
    message = str(e.value)
    assert message.startswith("stage iter-001/rollout failed (") and "\n" not in message, message
    run = spec.run_dir
    assert publish.read_manifest(f"{run}/iter-001/rollout") is not None
    assert publish.read_manifest(f"{run}/iter-001/scores") is None and not contract.published_parts(f"{run}/iter-001/scores")
    score_cfg = {n.name: n for n in build_dag(spec)}["iter-001/scores"].make_config()
    with pytest.raises(RuntimeError) as stage:
        pool1.run(score.run, score_cfg)
    error = str(stage.value).split("UserError: ", 1)[1].splitlines()[0]
    assert error.startswith(f"{run}/iter-001/rollout/parts/part-000000.parquet: rule 'rules_for_tests:raises' "
                            "failed on ('p0000', 0): ValueError: no"), error
    assert message == f"stage iter-001/rollout failed ({error}); fix it and rerun `llamarl run` — finished stages are kept"


def test_a_rollout_killed_between_its_publishes_scores_on_rerun(rules_run, pool1, tmp_path):
    """SIGKILL after the rollout published, before its scores: the rerun of the stage skips the
    rollout and publishes the scores, the bytes the score stage writes."""
    root, spec, _, _ = rules_run
    node = {n.name: n for n in build_dag(spec)}["iter-001/rollout"]
    cfg = node.make_config().model_dump(mode="json")
    out, scores = str(tmp_path / "rollout"), str(tmp_path / "scores")
    cfg |= {"out": out, "scores": cfg["scores"] | {"rollout": out, "out": scores,
                                                   "rewards": [{"name": "rules_for_tests:killed_once"}]}}
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29547", "LLAMARL_TEST_KILL_ONCE": str(tmp_path / "killed"),
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}

    def stage():
        return subprocess.run([sys.executable, "-m", "llamarl.stages.rollout", "--config-json", json.dumps(cfg)],
                              capture_output=True, text=True, timeout=300, env=env)

    killed = stage()
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert publish.read_manifest(out) is not None and publish.read_manifest(scores) is None
    rerun = stage()
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{out}: already rolled out with this actor and config, nothing to do" in rerun.stdout, rerun.stdout
    assert publish.read_manifest(scores) is not None
    by_stage = str(tmp_path / "by-stage")
    pool1.run(score.run, ScoreConfig.model_validate(cfg["scores"] | {"out": by_stage}))
    assert publish.read_manifest(scores)["request"] == publish.read_manifest(by_stage)["request"]
    assert _files(scores) == _files(by_stage)


def test_a_reward_model_run_scores_in_the_score_stage(tmp_path):
    nodes = build_dag(load_spec(demo.make_inputs(str(tmp_path))))
    rollouts = [n for n in nodes if n.stage == "rollout"]
    assert rollouts and all(n.make_config().scores is None for n in rollouts)
    assert len([n for n in nodes if n.stage == "score"]) == len(rollouts) == 6
