"""Config reading and layout checks: bad input is a one-line error naming the value and the fix."""

from __future__ import annotations

import pytest
import torch

import tiny
from llamarl.lib.model.config import ConfigError, LlamaConfig, ParallelLayout, pad_vocab, split_layers
from llamarl.lib.model.rotary import rope_inv_freq


def _cfg(**overrides):
    return LlamaConfig.from_hf(tiny.hf_config(**overrides).to_dict())


def _one_line_error(fn, *needles):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_reads_hf_config_both_rope_spellings():
    cfg = _cfg()
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 251)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    old_style = {**tiny.hf_config().to_dict()}
    old_style.pop("rope_parameters", None)
    old_style |= {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg2 = LlamaConfig.from_hf(old_style)
    assert cfg2.rope_theta == 500000.0 and cfg2.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg


def test_head_dim_read_from_config_when_not_hidden_over_heads():
    assert _cfg(head_dim=32).head_dim == 32


def test_rope_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for overrides in ({}, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {"rope_scaling": None}):
        hf = tiny.hf_config(**overrides)
        rope_type = hf.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            dim = hf.head_dim
            ref = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        else:
            ref, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        ours = rope_inv_freq(LlamaConfig.from_hf(hf.to_dict()))
        assert torch.allclose(ours, ref, rtol=1e-6), overrides


def test_non_llama_config_rejected():
    _one_line_error(lambda: LlamaConfig.from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "ckpt/config.json"),
                    "ckpt/config.json", "gpt2", "Llama")


def test_unsupported_rope_rejected():
    d = tiny.hf_config().to_dict()
    d.pop("rope_parameters", None)
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    _one_line_error(lambda: LlamaConfig.from_hf(d), "yarn", "llama3")


def test_tp_not_dividing_heads_rejected():
    _one_line_error(lambda: ParallelLayout(tp=3).check(_cfg()), "tp=3", "num_attention_heads=4", "[1, 2, 4]")


def test_pp_larger_than_layers_rejected():
    _one_line_error(lambda: ParallelLayout(pp=5).check(_cfg()), "pp=5", "num_hidden_layers=3", "pp <= 3")


def test_tp_and_kv_heads_incompatible_rejected():
    # 6 heads, 3 kv heads, tp=2: 2 does not divide 3 and 3 does not divide 2.
    _one_line_error(lambda: ParallelLayout(tp=2).check(_cfg(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8)),
                    "tp=2", "num_key_value_heads=3")


def test_vocab_padding_and_layer_split():
    assert pad_vocab(251, 2) == 252 and pad_vocab(128256, 8) == 128256 and pad_vocab(7, 4) == 8
    assert split_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert split_layers(5, 2, [1, 4]) == [range(0, 1), range(1, 5)]
    _one_line_error(lambda: split_layers(5, 2, [1, 3]), "[1, 3]", "5")


def test_zero_processes_is_refused_everywhere(tmp_path):
    import subprocess
    import sys

    from llamarl.lib.errors import UserError
    from llamarl.pipeline.spec import Layouts
    from llamarl.lib.options import Source, validate
    from llamarl.stages.config import PPOConfig, ShardConfig

    with pytest.raises(UserError, match=r"^spec: layout.rollout.tp=0: Input should be greater than or equal to 1$"):
        validate(Layouts, {"rollout": {"tp": 0}}, Source("spec", at="layout"))
    with pytest.raises(UserError, match=r"export.procs=0"):
        validate(Layouts, {"export": {"procs": 0}}, "spec: layout")
    with pytest.raises(UserError, match=r"^spec: ppo: dp=0: "):
        PPOConfig.parse(dict(rollout="r", scores="s", actor="a", out="o", dp=0), "spec: ppo")
    with pytest.raises(UserError, match=r"pp=-1"):
        ShardConfig.parse(dict(src="s", dst="d", pp=-1), "options")
    for args in (["shard", "SRC", str(tmp_path / "d"), "--tp", "0"], ["export", "CK", str(tmp_path / "e"), "--procs", "0"]):
        r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", *args], capture_output=True, text=True)
        assert r.returncode == 2 and "greater than or equal to 1" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_bad_option_files_and_rules_are_one_line_errors(tmp_path):
    import subprocess
    import sys

    def one_line(r):
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
        return r.stderr

    cli = [sys.executable, "-m", "llamarl.pipeline.cli", "stage"]
    assert "no such options file" in one_line(subprocess.run(
        cli + ["ppo", "R", "S", "A", str(tmp_path / "o"), "--config", str(tmp_path / "typo.yaml")], capture_output=True, text=True))
    (tmp_path / "bad.yaml").write_text("lr: [1, 2\n")
    assert "not valid YAML" in one_line(subprocess.run(
        cli + ["score", "R", str(tmp_path / "o"), "--config", str(tmp_path / "bad.yaml")], capture_output=True, text=True))
    (tmp_path / "unknown.yaml").write_text("advantage_typo: gae\n")
    assert "advantage_typo: unknown option; valid options: " in one_line(subprocess.run(
        cli + ["ppo", "R", "S", "A", str(tmp_path / "o"), "--config", str(tmp_path / "unknown.yaml")], capture_output=True, text=True))
    # A stage module started by hand (no torchrun environment) reads its --config the same way.
    assert "no such config file" in one_line(subprocess.run(
        [sys.executable, "-m", "llamarl.stages.ppo", "--config", str(tmp_path / "typo.yaml")], capture_output=True, text=True))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rule,needle", [
    ("rules_for_tests:raises", "rule 'rules_for_tests:raises' failed on ('p0000', 0): ValueError: no"),
    ("rules_for_tests:returns_none", "returned None for ('p0000', 0); a rule returns a number"),
    ("rules_for_tests:reads_absent_column", "reads column 'nope' that row ('p0000', 0) does not have"),
])
def test_a_failing_rule_is_one_line_naming_the_part_and_row(rule, needle):
    from llamarl.stages.config import RewardTerm
    from llamarl.stages.scoring import rule_scores

    import rules_for_tests  # noqa: F401  (importable by name from tests/)
    from llamarl.lib.rl import rewards

    rows = [{"prompt_id": "p0000", "sample_index": 0, "response": "hi"}]
    values, error = rule_scores(RewardTerm(name=rule), rewards.resolve(rule), rows, None, "R/parts/part-000000.parquet")
    assert values is None and error.startswith("R/parts/part-000000.parquet: ") and needle in error, error


def test_the_tp_hint_lists_only_sizes_that_work():
    cfg = _cfg(num_attention_heads=12, num_key_value_heads=4, head_dim=16, hidden_size=192, intermediate_size=96)
    with pytest.raises(ConfigError) as e:
        ParallelLayout(tp=6).check(cfg)
    assert str(e.value).endswith("use a tp in [1, 2, 4, 12]")
    for tp in (1, 2, 4, 12):
        ParallelLayout(tp=tp).check(cfg)


def _cli(*args, **env):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", *args], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize("stage,args,options,needle", [
    ("rollout", ["A", "P", "OUT"], "tp: 2\n", "error: {config}: tp is given by --tp on the command line; remove it from "
                                               "this file"),
    ("rollout", ["A", "P", "OUT"], "actor: elsewhere\n", "error: {config}: actor is given by ACTOR on the command line"),
    ("score", ["R", "OUT"], "reward_model: rm\n", "error: {config}: reward_model is given by --rm on the command line"),
    ("ppo", ["R", "S", "A", "OUT"], "critic: c\n", "error: {config}: critic is given by --critic on the command line"),
])
def test_a_stage_commands_config_file_cannot_set_what_its_arguments_set(tmp_path, stage, args, options, needle):
    # Once, the command line silently won over the file's value.
    config = tmp_path / "opts.yaml"
    config.write_text(options)
    r = _cli(stage, *[str(tmp_path / a) if a == "OUT" else a for a in args], "--config", str(config))
    assert r.returncode == 2 and r.stderr.strip() == r.stderr.strip().splitlines()[0], r.stderr
    assert r.stderr.startswith(needle.format(config=config)), r.stderr
    assert not (tmp_path / "OUT").exists()


def test_stage_command_errors_name_the_flag_or_the_file(tmp_path):
    r = _cli("shard", "SRC", str(tmp_path / "d"), "--dtype", "fp8")
    assert r.returncode == 2 and r.stderr == "error: --dtype='fp8': Input should be 'bf16', 'fp16' or 'fp32'\n", r.stderr
    (tmp_path / "sp.yaml").write_text("sequence_parallel: true\n")
    r = _cli("ppo", "R", "S", "A", str(tmp_path / "o"), "--config", str(tmp_path / "sp.yaml"))
    assert r.stderr == "error: sequence_parallel needs --tp > 1; raise --tp or turn sequence_parallel off\n", r.stderr
    r = _cli("score", "R", str(tmp_path / "o"))  # the default rewards are [rm]
    assert r.stderr == "error: rewards has an 'rm' term but no --rm is given; set --rm or drop the 'rm' term\n", r.stderr
    (tmp_path / "bad.yaml").write_text("rewards:\n  - {name: length\n")
    r = _cli("score", "R", str(tmp_path / "o"), "--config", str(tmp_path / "bad.yaml"))
    assert r.stderr.startswith(f"error: {tmp_path / 'bad.yaml'}: not valid YAML (line 3, column 1: "), r.stderr
    (tmp_path / "mb.yaml").write_text("micro_batch: 0\n")
    r = _cli("score", "R", str(tmp_path / "o"), "--rm", "RM", "--config", str(tmp_path / "mb.yaml"))
    assert r.stderr == f"error: {tmp_path / 'mb.yaml'}: micro_batch=0: Input should be greater than or equal to 1\n"


def test_export_verify_has_a_flag(monkeypatch):
    from typer.testing import CliRunner

    from llamarl.pipeline import cli

    ran = []
    monkeypatch.setattr(cli, "_run_local", lambda stage, config, made: ran.append(config))
    for flags, verify in (([], True), (["--no-verify"], False)):
        result = CliRunner().invoke(cli.app, ["stage", "export", "CK", "OUT", *flags])
        assert result.exit_code == 0, result.output
        assert ran.pop().verify is verify


def test_stage_help_lists_the_yaml_options():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", "ppo", "--help"], capture_output=True,
                         text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    for line in ("advantage = 'gae': gae | grpo", "dtype = 'auto'", "mini_batch_size = 8", "grad_clip = 1.0"):
        assert line in out, line
    out = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", "rollout", "--help"], capture_output=True,
                         text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    assert "sampling.temperature = 1.0" in out and "keep_columns = []" in out
    assert "actor = " not in out and "tp = " not in out  # set by arguments and flags, not by --config
    out = _cli("score", "--help").stdout
    for line in ("regex(pattern: str, full: bool = False): 1 if the response matches",
                 "length(target: int = 64, scale: float = 64.0, unit: str = 'tokens')",
                 "exact_match(column: str = 'answer', normalize: bool = True)", "contains(column: str = 'answer')"):
        assert line in out, line
