"""The run spec and the stage configs are validated whole, up front, in one line per error."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from llamarl.lib.errors import UserError
from llamarl.pipeline.run import build_dag, check_spec
from llamarl.pipeline.spec import parse_spec
from llamarl.stages.config import PPOConfig, ScoreConfig, StageConfig


def _spec(tmp_path, **changes) -> dict:
    spec = {"name": "t", "storage": str(tmp_path), "actor": str(tmp_path / "actor"), "prompts": str(tmp_path / "p.jsonl"),
            "reward_model": str(tmp_path / "rm"), "iterations": 2}
    for key, value in changes.items():
        spec[key] = value
    return spec


@pytest.mark.parametrize("changes,needle", [
    ({"ppo": {"advantage": "gea"}}, "spec.yaml: ppo.advantage='gea': Input should be 'gae' or 'grpo'"),
    ({"score": {"dtype": "fp8"}}, "spec.yaml: score.dtype='fp8': Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
    ({"rollout": {"sampling": {"top_p": 0}}}, "spec.yaml: rollout.sampling.top_p=0: Input should be greater than 0"),
    ({"rollout": {"sampling": {"temprature": 0.7}}}, "spec.yaml: rollout.sampling.temprature: unknown option; valid "
                                                     "options: samples_per_prompt, temperature"),
    ({"ppo": {"dual_clip": 0.5}}, "spec.yaml: ppo.dual_clip=0.5: Input should be greater than 1"),
    ({"ppo": {"actor": "/elsewhere"}}, "spec.yaml: ppo: actor is filled in by the pipeline"),
    ({"layout": {"ppo": {"dp": 0}}}, "spec.yaml: layout.ppo.dp=0: Input should be greater than or equal to 1"),
    ({"iterations": 0}, "spec.yaml: iterations=0: Input should be greater than or equal to 1"),
    ({"name": "a/b"}, "spec.yaml: name='a/b': use letters, digits"),
    ({"executor": {"kind": "ray"}}, "spec.yaml: executor.kind='ray': Input should be 'local', 'slurm' or 'kubernetes'"),
    ({"score": {"rewards": [{"name": "rm", "wieght": 2}]}}, "spec.yaml: score.rewards.0.wieght: unknown option"),
    ({"score": {"rewards": [{"name": "nosuchrule"}]}}, "score.rewards.0.name='nosuchrule': use rm, one of exact_match"),
    ({"score": {"rewards": []}}, "spec.yaml: score.rewards=[]: List should have at least 1 item"),
    ({"ppo": {"temperature": 0.7}}, "ppo.temperature=0.7 differs from rollout.sampling.temperature=1.0"),
    ({"ppo": {"sequence_parallel": True}}, "ppo.sequence_parallel needs layout.ppo.tp > 1"),
])
def test_a_wrong_value_anywhere_is_one_line_naming_the_field(tmp_path, changes, needle):
    with pytest.raises(UserError) as e:
        parse_spec(_spec(tmp_path, **changes), "spec.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_rm_term_needs_a_reward_model(tmp_path):
    spec = _spec(tmp_path)
    del spec["reward_model"]
    with pytest.raises(UserError, match="score.rewards has an 'rm' term but no reward_model is given"):
        parse_spec(spec, "spec.yaml")
    parse_spec({**spec, "score": {"rewards": [{"name": "length"}]}}, "spec.yaml")  # rules alone need none


def test_every_stage_of_every_iteration_is_built_before_anything_runs(tmp_path):
    spec = parse_spec(_spec(tmp_path, layout={"ppo": {"tp": 2}}, ppo={"sequence_parallel": True, "advantage": "grpo"}),
                      "spec.yaml")
    nodes = check_spec(spec)
    assert [n.name for n in nodes] == ["shard/actor", "shard/rm", "iter-001/rollout", "iter-001/scores", "iter-001/ppo",
                                       "iter-002/rollout", "iter-002/scores", "iter-002/ppo", "export"]
    ppo2 = next(n for n in nodes if n.name == "iter-002/ppo").make_config()
    assert isinstance(ppo2, PPOConfig) and ppo2.tp == 2 and ppo2.actor.endswith("iter-001/ppo/actor")
    assert ppo2.critic is None  # grpo trains no critic, so iteration 2 starts none


def test_identity_blanks_outputs_layout_and_placement_only():
    a = ScoreConfig.parse({"rollout": "r", "out": "o1", "reward_model": "rm", "tp": 1, "offload": True}, "x")
    b = ScoreConfig.parse({"rollout": "r", "out": "o2", "reward_model": "rm", "tp": 4, "dp": 2, "offload": False}, "x")
    c = ScoreConfig.parse({"rollout": "r", "out": "o1", "reward_model": "rm", "micro_batch": 4}, "x")
    assert a.identity() == b.identity() != c.identity()
    assert a.identity()["rollout"] == "r"  # inputs identify the output


def test_configs_round_trip_through_json():
    cfg = PPOConfig.parse({"rollout": "r", "scores": "s", "actor": "a", "out": "o", "betas": [0.8, 0.9]}, "x")
    again = PPOConfig.parse(cfg.to_json(), "x")
    assert again == cfg and again.betas == (0.8, 0.9)
    assert all(issubclass(c, StageConfig) for c in (PPOConfig, ScoreConfig))


def test_dry_run_refuses_a_bad_spec_fast_in_one_line(tmp_path):
    # `llamarl run --dry-run` validates without importing torch: a typo costs seconds, not GPU hours.
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, ppo={"advantage": "gea"})))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(path), "--dry-run"], capture_output=True,
                       text=True, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    seconds = time.perf_counter() - t0
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "ppo.advantage='gea'" in lines[0], r.stdout + r.stderr
    assert seconds < 3.0, f"{seconds:.1f} s"  # the goal is < 2 s; some slack for a loaded CI machine
    assert not (tmp_path / "t").exists()  # nothing written


def test_dry_run_of_a_good_spec_plans_without_torch(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path)))
    code = ("import sys; from llamarl.pipeline.cli import app; "
            f"sys.argv = ['llamarl', 'run', {str(path)!r}, '--dry-run']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'the dry run imported torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "iter-002/ppo" in r.stdout, r.stdout + r.stderr
    assert len(build_dag(parse_spec(_spec(tmp_path), "x"))) == 9


def test_dry_run_shows_what_each_stage_would_launch(tmp_path):
    from llamarl.pipeline.run import run_spec

    spec = parse_spec(_spec(tmp_path, layout={"rollout": {"tp": 2}}, iterations=1,
                            executor={"kind": "kubernetes", "options": {"image": "llamarl:1", "pvc": "runs"}}), "x")
    shown: list[str] = []
    plan = run_spec(spec, dry_run=True, show_launch=True, echo=shown.append)
    assert [name for name, _ in plan][2] == "iter-001/rollout" and len(shown) == len(plan)  # nothing is done yet
    rollout = yaml.safe_load_all(shown[2])
    kinds = [doc["kind"] for doc in rollout if doc]
    assert "Job" in kinds and "llamarl.stages.rollout" in shown[2]
    assert not (tmp_path / "t").exists()  # a dry run writes nothing
