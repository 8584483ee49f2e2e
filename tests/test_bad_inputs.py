"""Bad config values, one row each: refused in one line naming the field, both where a stage's
config is built (``llamarl stage NAME --config``) and where a run spec is loaded (``llamarl run``
and ``--dry-run``: ``parse_spec``), before anything runs or is written. Then a sweep over every
float field of every options model, so that a new field cannot escape the finite rule."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
import typing

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from llamarl.cluster.kubernetes import KubernetesOptions
from llamarl.cluster.local import LocalOptions
from llamarl.cluster.slurm import SlurmOptions
from llamarl.lib.errors import UserError, one_line
from llamarl.pipeline.dag import load_spec, parse_spec
from llamarl.pipeline.spec import RunSpec
from llamarl.stages.config import STAGES

INF, NAN = math.inf, math.nan

# What each stage's config needs besides the row's options (the pipeline fills these in a spec).
WIRED = {"shard": {"src": "s", "dst": "d"}, "rollout": {"actor": "a", "prompts": "p", "out": "o"},
         "score": {"rollout": "r", "out": "o"}, "ppo": {"rollout": "r", "scores": "s", "actor": "a", "out": "o"},
         "export": {"src": "s", "dst": "d"}}

CASES = [
    # where, options, a fragment of the one-line message (as both a stage config and a spec word it)
    # -- not finite: every float, nested ones and a rule's args included
    ("ppo", {"actor_lr": INF}, "actor_lr=inf: Input should be a finite number"),
    ("ppo", {"kl_coef": INF}, "kl_coef=inf: Input should be a finite number"),
    ("ppo", {"kl_coef": NAN}, "kl_coef=nan: Input should be a finite number"),
    ("ppo", {"entropy_coef": -INF}, "entropy_coef=-inf: Input should be a finite number"),
    ("ppo", {"clip_eps_high": NAN}, "clip_eps_high=nan: Input should be a finite number"),
    ("ppo", {"betas": [0.9, NAN]}, "betas.1=nan: Input should be a finite number"),
    ("ppo", {"grad_clip": INF}, "grad_clip=inf: Input should be a finite number"),
    ("ppo", {"tis_cap": INF}, "tis_cap=inf: Input should be a finite number"),
    ("rollout", {"sampling": {"temperature": INF}}, "sampling.temperature=inf: Input should be a finite number"),
    ("rollout", {"sampling": {"top_p": NAN}}, "sampling.top_p=nan: Input should be a finite number"),
    ("score", {"rewards": [{"name": "length", "weight": INF}]}, "rewards.0.weight=inf: Input should be a finite number"),
    ("score", {"rewards": [{"name": "length", "args": {"scale": NAN}}]}, "rewards.0.args: scale=nan: Input should be "
                                                                         "a finite number"),
    ("score", {"rewards": [{"name": "pkg.mod:rule", "args": {"bounds": [0, INF]}}]},
     "rewards.0.args: bounds.1=inf: Input should be a finite number"),
    ("export", {"max_shard_gb": INF}, "max_shard_gb=inf: Input should be a finite number"),
    # -- in range, representable
    ("ppo", {"actor_lr": 1e30}, "actor_lr=1e+30: Input should be less than or equal to 1"),
    ("ppo", {"critic_lr": 2.0}, "critic_lr=2.0: Input should be less than or equal to 1"),
    ("ppo", {"clip_eps": 1.0}, "clip_eps=1.0: Input should be less than 1"),
    ("ppo", {"seed": 2**63}, "seed=9223372036854775808: Input should be less than 4294967296"),
    ("ppo", {"seed": -1}, "seed=-1: Input should be greater than or equal to 0"),
    ("rollout", {"sampling": {"samples_per_prompt": 2**31}}, "sampling.samples_per_prompt=2147483648: Input should be "
                                                             "less than or equal to 2147483647"),
    ("rollout", {"collective_timeout_s": 0}, "collective_timeout_s=0: Input should be greater than or equal to 1"),
    ("export", {"collective_timeout_s": 10**15}, "collective_timeout_s=1000000000000000: Input should be less than "
                                                 "or equal to 1000000000"),
    # -- able to train
    ("ppo", {"actor_lr": 0, "advantage": "grpo"}, "actor_lr is 0 and ppo.advantage='grpo' trains no critic: no weight "
                                                  "would change; raise ppo.actor_lr"),
    ("ppo", {"actor_lr": 0, "critic_lr": 0}, "actor_lr and ppo.critic_lr are both 0: neither the actor nor the critic "
                                             "would change"),
    ("score", {"rewards": [{"name": "length", "weight": 0}, {"name": "contains", "weight": 0.0}]},
     "every term of score.rewards has weight 0, so every score would be 0"),
    # -- the run spec only: across stages, and the executor's options
    ("spec", {"ppo": {"advantage": "grpo"}, "rollout": {"sampling": {"samples_per_prompt": 4, "temperature": 0}}},
     "ppo.advantage='grpo' compares each prompt's samples with each other, but rollout.sampling.temperature=0 draws "
     "them greedily: every sample of a prompt is the same, so every advantage would be 0;"),
    ("spec", {"ppo": {"advantage": "rloo"}, "rollout": {"sampling": {"samples_per_prompt": 4, "top_k": 1}}},
     "but rollout.sampling.top_k=1 draws them greedily"),
    ("spec", {"ppo": {"dynamic_sampling": True}, "rollout": {"sampling": {"samples_per_prompt": 4, "temperature": 0}}},
     "so dynamic sampling would drop every prompt;"),
    ("spec", {"executor": {"kind": "local", "options": {"grace_s": INF}}},
     "executor.options.grace_s=inf: Input should be a finite number"),
    ("spec", {"executor": {"kind": "kubernetes", "options": {"image": "i", "pvc": "p", "poll_s": NAN}}},
     "executor.options.poll_s=nan: Input should be a finite number"),
    # -- found by tests/test_fuzz.py. Types as written (strict): no boolean for a number, no text for a count
    ("spec", {"retention": {"keep_last": True}}, "retention.keep_last=True: Input should be a valid integer"),
    ("score", {"rewards": [{"name": "length", "weight": False}]}, "rewards.0.weight=False: Input should be a valid number"),
    ("rollout", {"chunk_size": "4"}, "chunk_size='4': Input should be a valid integer"),
    ("spec", {"prompts_per_iteration": 1, "shuffle": "true"}, "shuffle='true': Input should be a valid boolean"),
    # -- bounded where a value meets something finite: memory, processes, float32, int32
    ("spec", {"iterations": 10**12}, "iterations=1000000000000: Input should be less than or equal to 10000"),
    ("spec", {"layout": {"rollout": {"dp": 10**30}}}, "layout.rollout: tp=1 × dp=10" + "0" * 29 + " is 1" + "0" * 30
                                                      + " processes, more than any job runs (at most 65536)"),
    ("spec", {"executor": {"kind": "local", "options": {"gpus": 10**30}}},
     "executor.options.gpus=1" + "0" * 30 + ": Input should be less than or equal to 1024"),
    ("rollout", {"sampling": {"temperature": 5e-324}}, "sampling.temperature=5e-324: Input should be 0 (greedy) or at "
                                                       "least 1e-06: logits / temperature would overflow float32"),
    ("ppo", {"temperature": 1e-9}, "temperature=1e-09: Input should be at least 1e-06: logits / temperature"),
    ("rollout", {"sampling": {"stop_token_ids": [2**31]}}, "sampling.stop_token_ids.0=2147483648: Input should be less "
                                                           "than or equal to 2147483647"),
    ("rollout", {"keep_columns": [""]}, "keep_columns.0='': String should have at least 1 character"),
    ("rollout", {"id_column": ""}, "id_column='': String should have at least 1 character"),
    ("score", {"rewards": [{"name": "regex", "args": {"pattern": "^(ye"}}]},
     "rewards.0.args: pattern='^(ye' is no regular expression (missing ), unterminated subpattern at position 1)"),
    # -- paths that a stage can open
    ("spec", {"prompts": "nosuch://p.jsonl"}, "prompts='nosuch://p.jsonl': nosuch:// is no storage fsspec knows"),
    ("spec", {"storage": ""}, "storage='': is empty; give a path or a URL"),
    ("spec", {"reward_model": "/models/rm\x00"}, "reward_model='/models/rm\\x00': holds a NUL character"),
    ("score", {"references": "nosuch://refs.jsonl"}, "references='nosuch://refs.jsonl': nosuch:// is no storage"),
    # -- a rule reads its column from the rollout's rows (score's references do not reach a validation)
    ("spec", {"score": {"rewards": [{"name": "exact_match", "args": {"column": "answr"}}]}},
     "score.rewards.0: rule 'exact_match' reads column 'answr', which no row of the rollout has"),
    ("spec", {"score": {"rewards": [{"name": "contains"}], "references": "refs.jsonl"}, "validation": {"prompts": "v.jsonl"}},
     "score.rewards.0: rule 'contains' reads column 'answer', which no row of the rollout has (rollout.keep_columns=[]); "
     "keep it in rollout.keep_columns, or give validation.references that have it"),
]


def _spec(tmp_path, where: str, options: dict) -> dict:
    spec = {"name": "t", "storage": str(tmp_path), "actor": str(tmp_path / "actor"),
            "prompts": str(tmp_path / "p.jsonl"), "reward_model": str(tmp_path / "rm"), "iterations": 2,
            # two samples a prompt: a row's group advantage is refused for its own reason, if any
            "rollout": {"sampling": {"samples_per_prompt": 2}}}
    return _merged(spec, options if where == "spec" else {where: options})


def _merged(a: dict, b: dict) -> dict:
    return a | {k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()}


def _one_line(fn) -> str:
    with pytest.raises(UserError) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("where,options,fragment", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_value_is_one_line_naming_the_field(tmp_path, where, options, fragment):
    spec_message = _one_line(lambda: parse_spec(_spec(tmp_path, where, options), "spec.yaml"))
    assert spec_message.startswith("spec.yaml: ") and fragment in spec_message, spec_message
    if where != "spec":  # the stage's own config, as `llamarl stage NAME --config opts.yaml` builds it
        message = _one_line(lambda: STAGES[where].parse(WIRED[where] | options, "opts.yaml"))
        assert message.startswith("opts.yaml: ") and fragment.replace(f"{where}.", "") in message, message
    assert not (tmp_path / "t").exists()  # nothing written


def test_dry_run_refuses_yaml_infinity_in_one_line(tmp_path):
    # YAML's own spellings of infinity and not-a-number reach the check as floats.
    spec = _spec(tmp_path, "spec", {})
    text = yaml.safe_dump(spec) + "ppo: {kl_coef: .inf}\n"
    (tmp_path / "spec.yaml").write_text(text)
    r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(tmp_path / "spec.yaml"), "--dry-run"],
                       capture_output=True, text=True)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and lines == [f"error: {tmp_path / 'spec.yaml'}: ppo.kl_coef=inf: Input should be a "
                                           "finite number"], r.stdout + r.stderr
    assert not (tmp_path / "t").exists()


def test_stop_tokens_beyond_the_actors_vocabulary_are_refused(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 251, "max_position_embeddings": 512}))
    message = _one_line(lambda: parse_spec(_spec(tmp_path, "rollout", {"sampling": {"stop_token_ids": [2, 251]}}),
                                           "spec.yaml"))
    assert message.startswith("spec.yaml: rollout.sampling.stop_token_ids.1=251 is no token of the actor, whose "
                              "vocabulary has 251 ("), message


# ---- files: what YAML lets through, and what no terminal prints ---------------------------------------------

BAD_YAML = [  # (a spec's or an options file's text, what its one line says after "FILE: ") — found by test_fuzz.py
    ("seed: 1\nseed: 2\n", "not valid YAML (line 2, column 1: 'seed' is given twice (first on line 1); keep one)"),
    ("ppo: {kl_coef: 0.1, kl_coef: 0.2}\n", "not valid YAML (line 1, column 21: 'kl_coef' is given twice (first on "
                                           "line 1); keep one)"),
    ('name: "t\\ud800"\n', "name: holds a lone surrogate ('\\ud800'), which no file or terminal can hold"),
    ('x: [{"\\udfff": 1}]\n', "x.0.\\udfff: holds a lone surrogate ('\\udfff')"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply to read; flatten it"),
    # a billion values in nine lines (each alias is the list it names), and a list that holds itself
    ("".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9)),
     "a8.8.8.8: stands for more than 100000 values (YAML aliases repeating aliases)"),
    ("rollout: &r {keep_columns: [*r]}\n", "rollout.keep_columns.0: holds itself (a YAML alias inside its own anchor)"),
]


@pytest.mark.parametrize("text,says", BAD_YAML, ids=["key-twice", "flow-key-twice", "surrogate", "surrogate-key", "deep",
                                                     "laughs", "itself"])
def test_a_yaml_file_that_means_no_one_thing_is_one_line(tmp_path, text, says, monkeypatch):
    from typer.testing import CliRunner

    from llamarl.lib.runtime.job import load_config
    from llamarl.pipeline import cli
    from llamarl.stages.config import ExportConfig

    path = tmp_path / "file.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert _one_line(lambda: load_spec(str(path))).startswith(f"{path}: {says}")  # llamarl run
    assert _one_line(lambda: load_config(ExportConfig, ["--config", str(path)])).startswith(f"{path}: {says}")  # a stage
    monkeypatch.setattr(cli, "_run_local", lambda *a: pytest.fail("started"))
    result = CliRunner().invoke(cli.app, ["stage", "score", "R", str(tmp_path / "o"), "--config", str(path)])
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {one_line(f'{path}: {says}')}"), \
        result.output


def test_yaml_merge_keys_may_override_what_they_merge(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(tmp_path, "spec", {})) + "base: &b {kl_coef: 0.1, actor_lr: 1.0e-6}\n"
                    "ppo:\n  <<: *b\n  kl_coef: 0.2\n")
    assert "base: unknown option" in _one_line(lambda: load_spec(str(path)))  # read whole, then the fields checked


@pytest.mark.parametrize("value", ["[/x]", "a\nb", "\x1b[31mred", "\u202eevil", "[bold]x"])
def test_an_error_line_is_one_printable_line_whatever_the_value_holds(tmp_path, value):
    # Once, `[/x]` was read as rich markup (a MarkupError traceback) and a newline split the line.
    from typer.testing import CliRunner

    from llamarl.pipeline import cli

    spec = _spec(tmp_path, "spec", {"name": value, "prompts": str(tmp_path / value / "p.jsonl")})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "spec.yaml"), "--dry-run"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output == f"error: {tmp_path / 'spec.yaml'}: name={one_line(repr(value))}: use letters, digits, '.', " \
                            "'_' and '-' (it names the run directory)\n"
    spec["name"] = "t"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "spec.yaml"), "--dry-run"])
    assert result.exit_code == 2 and result.output == f"error: {one_line(spec['prompts'])}: no such file or folder; " \
                                                      "check the prompts path\n", result.output


# ---- the sweep: every float of every options model --------------------------------------------------------


def _models() -> list[type[BaseModel]]:
    """Every options model: the stages' configs, the run spec and what it nests (the options models
    a spec sets, layouts), the executors' options."""
    seen: list[type[BaseModel]] = []

    def visit(model):
        if model in seen:
            return
        seen.append(model)
        for field in model.model_fields.values():
            for inner in _types(field.annotation):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    visit(inner)

    for model in (*STAGES.values(), RunSpec, LocalOptions, SlurmOptions, KubernetesOptions):
        visit(model)
    return seen


def _types(annotation) -> list:
    """``annotation`` and every type inside it (unions, lists, tuples, Annotated, dicts)."""
    out = [annotation]
    for arg in typing.get_args(annotation):
        out += _types(arg)
    return out


def _bad(annotation, value: float):
    """A value shaped as ``annotation`` with ``value`` in every float's place; None if it holds no float."""
    if annotation is float:
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _bad(args[0], value)
    if origin in (typing.Union, types.UnionType):
        return next((b for a in args if (b := _bad(a, value)) is not None), None)
    if origin in (list, tuple) and args:
        items = [_bad(a, value) for a in (args if origin is tuple else args[:1])]
        return None if all(i is None for i in items) else [value if i is None else i for i in items]
    if origin is dict and len(args) == 2:
        inner = _bad(args[1], value)
        return None if inner is None else {"k": inner}
    return None


def test_every_float_of_every_options_model_refuses_inf_and_nan():
    floats = []
    for model in _models():
        for name, field in model.model_fields.items():
            for value in (INF, -INF, NAN):
                bad = _bad(field.annotation, value)
                if bad is None:
                    break
                with pytest.raises(ValidationError) as e:
                    model.model_validate({name: bad})
                refused = [err for err in e.value.errors() if err["loc"][:1] == (name,) and err["type"] == "finite_number"]
                assert refused, f"{model.__name__}.{name}={bad!r} is accepted: {e.value.errors()}"
            else:
                floats.append(f"{model.__name__}.{name}")
    # The sweep reaches the nested models and the spec's own options models, not only the top level.
    assert {"PPOConfig.kl_coef", "PPOConfig.betas", "Sampling.temperature", "RewardTerm.weight", "PPOOptions.actor_lr",
            "ExportOptions.max_shard_gb", "LocalOptions.grace_s", "KubernetesOptions.poll_s"} <= set(floats), floats
