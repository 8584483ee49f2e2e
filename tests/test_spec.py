"""The run spec and the stage configs are validated whole, up front, in one line per error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from llamarl.lib.errors import UserError
from llamarl.pipeline.dag import Node, build_dag, check_spec, load_spec, parse_spec
from llamarl.pipeline.records import node_key
from llamarl.pipeline.spec import Layouts
from llamarl.stages.config import (ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig, StageConfig,
                                   options_model, processes)


def _spec(tmp_path, **changes) -> dict:
    spec = {"name": "t", "storage": str(tmp_path), "actor": str(tmp_path / "actor"), "prompts": str(tmp_path / "p.jsonl"),
            "reward_model": str(tmp_path / "rm"), "iterations": 2}
    for key, value in changes.items():
        spec[key] = value
    return spec


def _hf_model(folder, **changes) -> str:
    """An HF checkpoint folder with only its config.json: all the spec check reads."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 251,
              "max_position_embeddings": 512} | changes
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("changes,needle", [
    ({"ppo": {"advantage": "gea"}}, "spec.yaml: ppo.advantage='gea': Input should be 'gae', 'grpo', 'rloo', "
                                  "'reinforce++' or 'reinforce++-baseline'"),
    ({"score": {"dtype": "fp8"}}, "spec.yaml: score.dtype='fp8': Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
    ({"rollout": {"sampling": {"top_p": 0}}}, "spec.yaml: rollout.sampling.top_p=0: Input should be greater than 0"),
    ({"rollout": {"sampling": {"temprature": 0.7}}}, "spec.yaml: rollout.sampling.temprature: unknown option; valid "
                                                     "options: samples_per_prompt, temperature"),
    ({"ppo": {"dual_clip": 0.5}}, "spec.yaml: ppo.dual_clip=0.5: Input should be greater than 1"),
    ({"ppo": {"actor": "/elsewhere"}}, "spec.yaml: ppo: actor is filled in by the pipeline"),
    ({"ppo": {"tp": 2}}, "spec.yaml: ppo: tp is set in layout.ppo.tp, not here; move it there"),
    ({"ppo": 5}, "spec.yaml: ppo=5: expected a mapping of options (collective_timeout_s, "),
    ({"layout": {"ppo": 3}}, "spec.yaml: layout.ppo=3: expected a mapping of options (tp, pp, dp, nodes)"),
    ({"layout": {"ppo": {"dp": 0}}}, "spec.yaml: layout.ppo.dp=0: Input should be greater than or equal to 1"),
    ({"iterations": 0}, "spec.yaml: iterations=0: Input should be greater than or equal to 1"),
    ({"name": "a/b"}, "spec.yaml: name='a/b': use letters, digits"),
    ({"executor": {"kind": "ray"}}, "spec.yaml: executor.kind='ray': Input should be 'local', 'slurm' or 'kubernetes'"),
    ({"score": {"rewards": [{"name": "rm", "wieght": 2}]}}, "spec.yaml: score.rewards.0.wieght: unknown option"),
    ({"score": {"rewards": [{"name": "nosuchrule"}]}}, "score.rewards.0.name='nosuchrule': use rm, one of exact_match"),
    ({"score": {"rewards": []}}, "spec.yaml: score.rewards=[]: List should have at least 1 item"),
    ({"ppo": {"temperature": 0.7}}, "ppo.temperature=0.7 differs from rollout.sampling.temperature=1.0"),
    ({"ppo": {"sequence_parallel": True}}, "spec.yaml: ppo.sequence_parallel needs layout.ppo.tp > 1; raise "
                                           "layout.ppo.tp or turn ppo.sequence_parallel off"),
    # Each stage's layout takes only the counts that stage uses.
    ({"layout": {"rollout": {"pp": 2}}}, "spec.yaml: layout.rollout.pp: unknown option; valid options: tp, dp, nodes"),
    ({"layout": {"shard": {"dp": 2}}}, "spec.yaml: layout.shard.dp: unknown option; valid options: tp, pp, nodes"),
    ({"layout": {"export": {"tp": 2}}}, "spec.yaml: layout.export.tp: unknown option; valid options: procs, nodes"),
    ({"layout": {"ppo": {"tp": 2, "dp": 3, "nodes": 4}}},
     "spec.yaml: layout.ppo: 6 processes (tp × pp × dp) do not spread evenly over nodes=4; use nodes that divide 6"),
    ({"layout": {"export": {"procs": 3, "nodes": 2}}}, "layout.export: 3 processes (procs) do not spread evenly"),
    ({"layout": {"ppo": {"dp": 2, "nodes": 2}}}, "spec.yaml: layout.ppo.nodes=2 needs a cluster executor: the local "
                                                 "executor runs on this machine only; set executor.kind to slurm or "
                                                 "kubernetes"),
    ({"ppo": {"advantage": "grpo"}}, "spec.yaml: ppo.advantage='grpo' needs rollout.sampling.samples_per_prompt >= 2"),
    ({"ppo": {"advantage": "rloo"}}, "spec.yaml: ppo.advantage='rloo' needs rollout.sampling.samples_per_prompt >= 2"),
    ({"ppo": {"advantage": "reinforce++-baseline", "dynamic_sampling": True}},
     "spec.yaml: ppo.advantage='reinforce++-baseline' and ppo.dynamic_sampling needs "
     "rollout.sampling.samples_per_prompt >= 2 (it is 1)"),
    ({"ppo": {"dynamic_sampling": True}}, "spec.yaml: ppo.dynamic_sampling needs rollout.sampling.samples_per_prompt >= 2"),
    ({"ppo": {"lr_decay": "cosine"}}, "spec.yaml: ppo.lr_decay='cosine' decays over ppo.total_steps, which is not "
                                      "set; set ppo.total_steps, or set ppo.lr_decay to 'constant'"),
    ({"ppo": {"lr_decay": "linear", "warmup_steps": 10, "total_steps": 10}},
     "spec.yaml: ppo.total_steps=10 must be larger than ppo.warmup_steps=10"),
    ({"ppo": {"save_every": -1}}, "spec.yaml: ppo.save_every=-1: Input should be greater than or equal to 0"),
    # A built-in rule's args are bound against its signature (after the response and the row).
    ({"score": {"rewards": [{"name": "regex"}]}},
     "spec.yaml: score.rewards.0.args: missing a required argument: 'pattern'; regex takes pattern: str, full: bool"),
    ({"score": {"rewards": [{"name": "contains", "args": {"colum": "answer"}}]}},
     "spec.yaml: score.rewards.0.args: got an unexpected keyword argument 'colum'; contains takes column: str"),
    ({"score": {"rewards": [{"name": "length", "args": {"target": "64"}}]}},
     "spec.yaml: score.rewards.0.args: target='64': Input should be a valid integer; length takes target: int = 64"),
    ({"score": {"rewards": [{"name": "rm", "args": {"scale": 2}}]}},
     "spec.yaml: score.rewards.0.args: the reward model takes no args"),
    ({"score": {"rewards": [{"name": "contains"}, {"name": "contains", "args": {"column": "b"}}]}},
     "spec.yaml: score.rewards: 'contains' is given twice"),
    # The executor's options, named as the spec nests them (no "executor: options:").
    ({"executor": {"kind": "kubernetes", "options": {"imag": "x", "pvc": "runs"}}},
     "spec.yaml: executor.options.imag: unknown option; valid options: image, pvc"),
    ({"executor": {"kind": "slurm", "options": {"timeout_min": "soon"}}},
     "spec.yaml: executor.options.timeout_min='soon': Input should be a valid integer"),
])
def test_a_wrong_value_anywhere_is_one_line_naming_the_field(tmp_path, changes, needle):
    with pytest.raises(UserError) as e:
        parse_spec(_spec(tmp_path, **changes), "spec.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_rm_term_needs_a_reward_model(tmp_path):
    spec = _spec(tmp_path)
    del spec["reward_model"]
    with pytest.raises(UserError, match=r"^spec.yaml: score.rewards has an 'rm' term but no reward_model is given; "
                                        r"set reward_model or drop the 'rm' term$"):
        parse_spec(spec, "spec.yaml")
    parse_spec({**spec, "score": {"rewards": [{"name": "length"}]}}, "spec.yaml")  # rules alone need none


def test_what_the_checks_allow_still_loads(tmp_path):
    spec = parse_spec(_spec(tmp_path, layout={"ppo": {"tp": 2, "dp": 2, "nodes": 2}, "export": {"procs": 4, "nodes": 2}},
                            executor={"kind": "slurm", "options": {"partition": "gpu"}},
                            rollout={"sampling": {"samples_per_prompt": 2}},
                            ppo={"advantage": "grpo", "lr_decay": "cosine", "warmup_steps": 2, "total_steps": 3},
                            score={"rewards": [{"name": "regex", "args": {"pattern": "^yes", "full": True}},
                                               {"name": "length", "args": {"scale": 8}}]}), "spec.yaml")
    assert processes(spec.layout.ppo) == 4 and processes(spec.layout.export) == 4


def test_cross_field_checks_live_in_the_stage_config_alone():
    # The spec's options model has the stage's fields but none of its checks across fields: the
    # spec reaches those by building the whole stage config (check_spec), so each is written once.
    for cls in (ScoreConfig, PPOConfig):
        assert not options_model(cls).__pydantic_decorators__.model_validators.keys() - {"_not_wired"}
    with pytest.raises(UserError, match=r"^x: sequence_parallel needs tp > 1; raise tp or turn sequence_parallel off$"):
        PPOConfig.parse({"rollout": "r", "scores": "s", "actor": "a", "out": "o", "sequence_parallel": True}, "x")


@pytest.mark.parametrize("layout,model,needle", [
    ({"ppo": {"tp": 3}}, {}, "spec.yaml: layout.ppo: tp=3 does not divide num_attention_heads=4; use a tp in [1, 2, 4] "
                             "(the actor: "),
    ({"rollout": {"tp": 2}}, {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3},
     "spec.yaml: layout.rollout: tp=2 and num_key_value_heads=3: one must divide the other"),
    ({"shard": {"pp": 4}}, {}, "spec.yaml: layout.shard: pp=4 is larger than num_hidden_layers=3; use pp <= 3"),
    ({"ppo": {"tp": 2}}, {"intermediate_size": 99}, "layout.ppo: tp=2 does not divide intermediate_size=99"),
])
def test_layouts_are_checked_against_the_actors_config(tmp_path, layout, model, needle):
    actor = _hf_model(tmp_path / "actor", **model)
    with pytest.raises(UserError) as e:
        parse_spec(_spec(tmp_path, layout=layout, actor=actor), "spec.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_reward_models_config_is_checked_against_score_and_shard(tmp_path):
    actor = _hf_model(tmp_path / "actor")
    rm = _hf_model(tmp_path / "rm", num_attention_heads=2, num_key_value_heads=2, hidden_size=32,
                   architectures=["LlamaForSequenceClassification"])
    with pytest.raises(UserError, match=r"^spec.yaml: layout.score: tp=4 does not divide num_attention_heads=2; .*"
                                        r"\(the reward model: .*rm/config.json\)$"):
        parse_spec(_spec(tmp_path, actor=actor, reward_model=rm, layout={"score": {"tp": 4}}), "spec.yaml")
    # Rules alone never load the reward model in score: its layout there is not checked.
    parse_spec(_spec(tmp_path, actor=actor, reward_model=rm, layout={"score": {"tp": 4}},
                     score={"rewards": [{"name": "length"}]}), "spec.yaml")
    with pytest.raises(UserError, match=r"^spec.yaml: layout.shard: tp=4 does not divide num_attention_heads=2"):
        parse_spec(_spec(tmp_path, actor=actor, reward_model=rm, layout={"shard": {"tp": 4}}), "spec.yaml")


def test_a_bad_model_config_and_a_long_response_fail_at_load(tmp_path):
    gpt2 = _hf_model(tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UserError, match=r"^spec.yaml: actor: .*gpt2/config.json: model_type='gpt2' is not a Llama"):
        parse_spec(_spec(tmp_path, actor=gpt2), "spec.yaml")
    short = _hf_model(tmp_path / "short", max_position_embeddings=256)
    with pytest.raises(UserError, match=r"^spec.yaml: rollout.sampling.max_new_tokens=256 leaves no room for a prompt "
                                        r"within the actor's max_position_embeddings=256"):
        parse_spec(_spec(tmp_path, actor=short), "spec.yaml")
    parse_spec(_spec(tmp_path, actor=_hf_model(tmp_path / "fine"), layout={"ppo": {"tp": 4, "pp": 3}}), "spec.yaml")


def test_every_stage_of_every_iteration_is_built_before_anything_runs(tmp_path):
    spec = parse_spec(_spec(tmp_path, layout={"ppo": {"tp": 2}}, ppo={"sequence_parallel": True, "advantage": "grpo"},
                            rollout={"sampling": {"samples_per_prompt": 4}}), "spec.yaml")
    nodes = check_spec(spec)
    assert [n.name for n in nodes] == ["shard/actor", "shard/rm", "iter-001/rollout", "iter-001/scores", "iter-001/ppo",
                                       "iter-002/rollout", "iter-002/scores", "iter-002/ppo", "export"]
    ppo2 = next(n for n in nodes if n.name == "iter-002/ppo").make_config()
    assert isinstance(ppo2, PPOConfig) and ppo2.tp == 2 and ppo2.actor.endswith("iter-001/ppo/actor")
    assert ppo2.critic is None  # grpo trains no critic, so iteration 2 starts none


def test_identity_leaves_out_outputs_layout_and_placement_only():
    a = ScoreConfig.parse({"rollout": "r", "out": "o1", "reward_model": "rm", "tp": 1, "offload": True}, "x")
    b = ScoreConfig.parse({"rollout": "r", "out": "o2", "reward_model": "rm", "tp": 4, "dp": 2, "offload": False,
                           "collective_timeout_s": 60}, "x")
    c = ScoreConfig.parse({"rollout": "r", "out": "o1", "reward_model": "rm", "micro_batch": 4}, "x")
    assert a.identity() == b.identity() != c.identity()
    assert a.identity()["rollout"] == "r"  # inputs identify the output
    assert not {"out", "tp", "pp", "dp", "offload", "collective_timeout_s"} & a.identity().keys()


def test_how_ppo_and_rollout_run_is_no_part_of_their_identity_but_rollout_chunks_are():
    # sequence_parallel gives the same update (tests/test_ppo.py: tp2-sp against tp1) and
    # save_every only how often a resumable state is saved (a resumed run is bit-identical).
    ppo = {"rollout": "r", "scores": "s", "actor": "a", "out": "o"}
    plain = PPOConfig.parse(ppo | {"tp": 1}, "x").identity()
    assert PPOConfig.parse(ppo | {"tp": 2, "sequence_parallel": True, "save_every": 5}, "x").identity() == plain
    # Sampling is keyed per (seed, row, sample), so max_batch (engine slots) draws the same rows
    # (tests/test_rollout.py); chunk_size still decides the part files a rerun resumes from.
    rollout = {"actor": "a", "prompts": "p", "out": "o"}
    default = RolloutConfig.parse(rollout, "x").identity()
    assert RolloutConfig.parse(rollout | {"max_batch": 4}, "x").identity() == default
    assert RolloutConfig.parse(rollout | {"chunk_size": 32}, "x").identity() != default


# The pipeline's key of each stage's default config (fixed paths, no inputs published, and what
# it reads from outside the run — shard's SRC, rollout's PROMPTS — absent): a change to any
# stage's identity — a new option, a new default, an option changing kind — changes these. Make it on purpose: update the constant, and say under
# "Upgrading" in docs/pipeline.md which stages an older run reruns.
GOLDEN_KEYS = {
    "shard": "042976217f886a48",
    "rollout": "83862710ca6cd59b",
    "score": "c61100ef0a15e5cb",
    "ppo": "4c1ff0bc48bea11f",
    "export": "70aba1e5750d6545",
}


def test_each_stages_identity_key_is_deliberate():
    defaults = {"shard": ShardConfig(src="SRC", dst="DST"),
                "rollout": RolloutConfig(actor="ACTOR", prompts="PROMPTS", out="OUT"),
                "score": ScoreConfig(rollout="ROLLOUT", out="OUT", reward_model="RM"),
                "ppo": PPOConfig(rollout="ROLLOUT", scores="SCORES", actor="ACTOR", out="OUT"),
                "export": ExportConfig(src="SRC", dst="DST")}
    keys = {stage: node_key(Node(stage, stage, "OUT", [], getattr(Layouts(), stage), lambda c=cfg: c), {})
            for stage, cfg in defaults.items()}
    assert keys == GOLDEN_KEYS


def test_configs_round_trip_through_json():
    cfg = PPOConfig.parse({"rollout": "r", "scores": "s", "actor": "a", "out": "o", "betas": [0.8, 0.9]}, "x")
    again = PPOConfig.parse(cfg.to_json(), "x")
    assert again == cfg and again.betas == (0.8, 0.9)
    assert all(issubclass(c, StageConfig) for c in (PPOConfig, ScoreConfig))


@pytest.mark.parametrize("changes,needle", [
    ({"ppo": {"advantage": "gea"}}, "ppo.advantage='gea'"),
    ({"layout": {"ppo": {"tp": 3}}}, "layout.ppo: tp=3 does not divide num_attention_heads=4"),  # read from config.json
    ({"score": {"rewards": [{"name": "regex", "args": {"patern": "x"}}]}}, "score.rewards.0.args: "),
    # One prompt, one sample (the default), mini-batches of 8: a step an iteration; at total_steps 1 the second trains nothing.
    ({"ppo": {"lr_decay": "linear", "total_steps": 1}}, "spec.yaml: ppo.total_steps=1: lr_decay 'linear' brings the "
     "learning rate to 0 at that optimizer step, but each iteration takes 1 (1 epoch(s) of 1 samples in mini-batches of "
     "8), so iteration 2 would train nothing; set ppo.total_steps to 2 (the run's steps), or ppo.lr_decay: constant"),
], ids=["option", "model", "rule-args", "lr-schedule"])
def test_dry_run_refuses_a_bad_spec_fast_in_one_line(tmp_path, changes, needle):
    # `llamarl run --dry-run` validates without importing torch: a typo costs seconds, not GPU hours.
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, actor=_hf_model(tmp_path / "actor"), **changes)))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(path), "--dry-run"], capture_output=True,
                       text=True, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    seconds = time.perf_counter() - t0
    print(f"llamarl run --dry-run refused {needle!r} in {seconds:.2f} s")
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stdout + r.stderr
    assert seconds < 3.0, f"{seconds:.1f} s"  # the goal is < 2 s; some slack for a loaded CI machine
    assert not (tmp_path / "t").exists()  # nothing written


def test_a_reader_that_leaves_stops_what_llamarl_run_shows_not_the_run(tmp_path):
    # `llamarl run … | head`: a long run's plan, with what each stage launches, is more than the
    # pipe holds (200 kB); once head has its line, the rest is dropped and the command ends as it
    # would have.
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, actor=_hf_model(tmp_path / "actor"), iterations=60)))
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(path), "--dry-run", "--show-launch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and first and err == "", err


def test_a_stage_whose_stdout_nobody_reads_goes_on():
    from llamarl.lib.runtime.job import _UnreadStdout

    read, write = os.pipe()
    os.close(read)
    out = _UnreadStdout(os.fdopen(write, "w"))
    assert out.write("progress\n") == len("progress\n")
    out.flush()  # the pipe's reader is gone: dropped, and fd 1's kin with it (now /dev/null)
    out.write("more\n")
    out.flush()
    assert os.readlink(f"/proc/self/fd/{out.fileno()}") == os.devnull
    out.close()


def test_apply_needs_the_kubernetes_executor(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(path), "--apply"], capture_output=True,
                       text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and lines == [f"error: {path}: --apply creates Kubernetes Jobs, but executor.kind is "
                                           "'local'; drop --apply, or use executor.kind: kubernetes"], lines
    assert not (tmp_path / "t").exists()  # refused before anything ran


def test_a_yaml_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("name: t\nstorage: /s\nppo: {advantage: gae\nexport: {}\n")
    with pytest.raises(UserError, match=rf"^{path}: not valid YAML \(line 4, column 7: expected ',' or '}}', but got "
                                        r"':'\)$"):
        load_spec(str(path))


def test_dry_run_of_a_good_spec_plans_without_torch(tmp_path):
    # The actor's and the reward model's config.json are read and checked, still without torch.
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, actor=_hf_model(tmp_path / "actor"),
                                         reward_model=_hf_model(tmp_path / "rm"))))
    code = ("import sys; from llamarl.pipeline.cli import app; "
            f"sys.argv = ['llamarl', 'run', {str(path)!r}, '--dry-run']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'the dry run imported torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "iter-002/ppo" in r.stdout, r.stdout + r.stderr
    assert len(build_dag(parse_spec(_spec(tmp_path), "x"))) == 9


def test_a_long_runs_dry_run_names_a_few_stages_beside_each_and_counts_the_rest(tmp_path):
    # A validation may run beside every stage after it: naming them all made the plan's text grow
    # as n² (found by tests/test_fuzz.py: a dry run of 1000 iterations took 131 s).
    from llamarl.pipeline.run import run_spec

    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    spec = parse_spec(_spec(tmp_path, iterations=300, validation={"prompts": str(tmp_path / "p.jsonl"), "every": 1}), "x")
    plan = dict(run_spec(spec, dry_run=True, echo=lambda m: None))
    # 300 × (rollout, scores, ppo, val-rollout, val-scores) and the export; not its 3 inputs, itself, its val-scores
    assert plan["iter-001/val-rollout"].endswith("may run beside iter-002/rollout, iter-002/scores, iter-002/ppo and "
                                                 f"{300 * 5 + 1 - 5 - 3} more"), plan["iter-001/val-rollout"]
    # and the last validation beside every validation before it, and the export
    assert plan["iter-300/val-rollout"].endswith("may run beside iter-001/val-rollout, iter-001/val-scores, "
                                                 f"iter-002/val-rollout and {299 * 2 + 1 - 3} more")


def test_dry_run_shows_what_each_stage_would_launch(tmp_path):
    from llamarl.pipeline.run import run_spec

    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    spec = parse_spec(_spec(tmp_path, layout={"rollout": {"tp": 2}}, iterations=1,
                            executor={"kind": "kubernetes", "options": {"image": "llamarl:1", "pvc": "runs"}}), "x")
    shown: list[str] = []
    plan = run_spec(spec, dry_run=True, show_launch=True, echo=shown.append)
    assert [name for name, _ in plan][2] == "iter-001/rollout" and len(shown) == len(plan)  # nothing is done yet
    rollout = yaml.safe_load_all(shown[2])
    kinds = [doc["kind"] for doc in rollout if doc]
    assert "Job" in kinds and "llamarl.stages.rollout" in shown[2]
    assert not (tmp_path / "t").exists()  # a dry run writes nothing


def test_a_stage_runs_on_the_processes_its_config_and_its_layout_both_say(tmp_path):
    spec = parse_spec(_spec(tmp_path, layout={"shard": {"tp": 2, "pp": 2}, "rollout": {"tp": 2, "dp": 3},
                                              "ppo": {"tp": 2, "pp": 2, "dp": 2}, "export": {"procs": 3}}), "spec.yaml")
    counts = {n.name: (n.nprocs, processes(n.make_config())) for n in check_spec(spec)}
    assert counts["shard/actor"] == (4, 4) and counts["iter-001/rollout"] == (6, 6)
    assert counts["iter-001/ppo"] == (8, 8) and counts["export"] == (3, 3) and counts["iter-001/scores"] == (1, 1)


def test_the_pipeline_and_the_stage_read_one_declaration(tmp_path):
    # The node's key and the stage's own request both take the identity from stages/identity.py,
    # and what the pipeline fingerprints outside the run is what the stage's config reads.
    from llamarl.stages.identity import declare

    spec = parse_spec(_spec(tmp_path, validation={"prompts": str(tmp_path / "val.jsonl")}), "spec.yaml")
    nodes = {n.name: n for n in check_spec(spec)}
    assert nodes["shard/actor"].declared.external == (spec.actor,)
    assert nodes["shard/rm"].declared.external == (spec.reward_model,)
    assert nodes["iter-001/rollout"].declared.external == (spec.prompts,)
    assert nodes["iter-002/val-rollout"].declared.external == (str(tmp_path / "val.jsonl"),)
    assert all(not nodes[n].declared.external for n in ("iter-001/scores", "iter-001/ppo", "export"))
    ppo = nodes["iter-002/ppo"]
    declared = declare(ppo.make_config())
    assert declared.identity == ppo.make_config().identity() == ppo.declared.identity
    assert declared.inputs["actor"].endswith("iter-001/ppo/actor") and declared.inputs["reference"].endswith("shard/actor")
