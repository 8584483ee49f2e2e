"""A hostile randomized test (#27): mutated run specs to ``llamarl run SPEC --dry-run`` and mutated
prompts files to ``llamarl stage rollout``, through the real command line (``llamarl.pipeline.cli:app``
in this process, typer's CliRunner). Every case either runs or is refused with exit status 2 and
exactly one line, ``error: …``, that names a file the case gave — never a traceback, never exit
status 1, never a hang (each case has ``CASE_TIMEOUT_S``), and a refused case wrote nothing.

The mutations (tests/mutate.py) start from a good spec and a good prompts file: a value of another
type, nan/inf, huge, negative, zero, empty, very long, Unicode (emoji, RTL marks, NUL, lone
surrogates, combining marks), unknown keys, a key given twice, a value moved into another mapping,
a value wrapped in a list; the file's bytes bent (invalid UTF-8, a NUL, a cut, joined lines,
CRLF); and files that are folders, missing, empty, FIFOs, Parquet with odd column types.

What runs for real, and why: ``run --dry-run`` is what a user runs, and it starts no process: every
spec case runs it whole. ``stage rollout`` checks the prompts (every row, stages/prompts.py) and
the actor in the launching process, torch-free, before it starts any rank; each rank imports torch
(seconds), so a prompts case the launcher refuses is done there, and a case it accepts is recorded
(``cli._run_local`` replaced) and not started — except ``REAL_ROLLOUTS`` of them, one JSON lines
and one Parquet case, that run on the tiny actor (pipeline/toy.py, 4 new tokens) to show that what
the launcher accepts the stage rolls out. ``LLAMARL_FUZZ_REAL=all`` runs every accepted case so.

Replay: the cases are drawn from ``LLAMARL_FUZZ_SEED`` (0 in CI; set another to explore),
``LLAMARL_FUZZ_CASES`` of each kind; a failure prints its case whole (its mutations and the file's
bytes), and ``LLAMARL_FUZZ_CASE=N`` runs case N alone.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from llamarl.lib.files import publish
from llamarl.pipeline import cli
from llamarl.stages import contract, prompts
from llamarl.stages.config import RolloutConfig
from mutate import bend_bytes, mutate, plain, to_json, to_yaml

SEED = int(os.environ.get("LLAMARL_FUZZ_SEED", "0"))
CASES = int(os.environ.get("LLAMARL_FUZZ_CASES", "240"))
ONLY = os.environ.get("LLAMARL_FUZZ_CASE")
REAL = os.environ.get("LLAMARL_FUZZ_REAL", "")
CASE_TIMEOUT_S = 20
REAL_ROLLOUTS = 2


@dataclass
class Case:
    kind: str
    number: int
    what: list[str] = field(default_factory=list)
    path: str = ""
    data: bytes | None = None  # the file's bytes, where the case is one file
    options: dict = field(default_factory=dict)  # the rollout's --config

    def __str__(self) -> str:
        shown = repr(self.data) if self.data is None or len(self.data) < 4000 else repr(self.data[:4000]) + " …"
        return (f"{self.kind} case {self.number} (LLAMARL_FUZZ_SEED={SEED} LLAMARL_FUZZ_CASE={self.number}): "
                f"{'; '.join(self.what)}\n  path: {self.path}\n  options: {self.options}\n  bytes: {shown}")


class Hang(BaseException):
    """A case ran past its time (a BaseException: the CLI runner passes it through)."""


@contextmanager
def time_limit(seconds: float):
    def expired(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def invoke(args: list[str], case: Case):
    try:
        with time_limit(CASE_TIMEOUT_S):
            return CliRunner().invoke(cli.app, args)
    except Hang as e:
        pytest.fail(f"{e}: {case}")


def ran_or_refused(result, case: Case, names: list[str]) -> bool:
    """True if the command ran, False if it was refused in one line naming one of ``names``; fails the test otherwise."""
    if result.exit_code == 0:
        return True
    if result.exit_code != 2:
        import traceback

        trace = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else result.output
        pytest.fail(f"exit status {result.exit_code}, not 0 or 2:\n{trace}\n{case}")
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one line:\n{result.output}\n{case}"
    assert any(n and n in lines[0] for n in names), f"names no file of the case:\n{lines[0]}\n{case}"
    return False


def cases() -> list[int]:
    return [int(ONLY)] if ONLY else list(range(CASES))


# ---- the world the cases start from ---------------------------------------------------------------------------

ROWS = [{"prompt": "what is two plus two?", "id": "p0", "answer": "four"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello llama"}], "id": "p1",
         "answer": "hello"},
        {"prompt": "count one two three", "id": "p2", "answer": "four"},
        {"prompt": [{"role": "user", "content": "the cat sat on the"}], "id": "p3", "answer": "mat"},
        {"prompt": "answer with yes or no", "id": 4, "answer": "yes"},
        {"prompt": "a stitch in time", "id": "p5", "answer": "saves nine"}]
PARQUET_ROWS = [{"prompt": r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"], "id": str(r["id"]),
                 "answer": r["answer"]} for r in ROWS]  # one type a column, as Parquet has them
OPTIONS = {"id_column": "id", "keep_columns": ["answer"], "chunk_size": 4,
           "sampling": {"max_new_tokens": 4, "samples_per_prompt": 2}}


def _jsonl(path: str, rows: list) -> str:
    with open(path, "w") as f:
        f.writelines(to_json(r) + "\n" for r in rows)
    return path


def _hf_config(folder: str) -> str:
    """An HF checkpoint folder with only its config.json: all a dry run reads of a model."""
    os.makedirs(folder)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301,
              "max_position_embeddings": 512}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("fuzz"))
    spec = {"name": "fuzz", "storage": f"{root}/runs", "actor": _hf_config(f"{root}/actor"),
            "reward_model": _hf_config(f"{root}/rm"), "prompts": _jsonl(f"{root}/prompts.jsonl", ROWS),
            "prompts_per_iteration": 4, "shuffle": True, "seed": 7, "iterations": 3,
            "validation": {"prompts": _jsonl(f"{root}/val.jsonl", ROWS[:3]), "every": 2,
                           "sampling": {"temperature": 0, "samples_per_prompt": 1}, "pass_threshold": 1.0},
            "retention": {"keep_last": 1, "keep_every": 2, "keep_samples": False},
            "metrics": {"tensorboard": f"{root}/tb"}, "max_staleness": 1,
            "layout": {"shard": {"tp": 2}, "rollout": {"tp": 2, "dp": 1}, "score": {"tp": 1}, "ppo": {"tp": 2, "pp": 1},
                       "export": {"procs": 2}},
            "rollout": {"id_column": "id", "keep_columns": ["answer"], "chunk_size": 2,
                        "sampling": {"samples_per_prompt": 4, "temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16,
                                     "stop_token_ids": [2]}},
            "score": {"rewards": [{"name": "exact_match", "args": {"column": "answer"}}, {"name": "rm", "weight": 0.5},
                                  {"name": "regex", "weight": 0.1, "args": {"pattern": "^(yes|no)"}}]},
            "ppo": {"advantage": "grpo", "mini_batch_size": 4, "actor_lr": 1e-6, "kl_coef": 0.001, "betas": [0.9, 0.95],
                    "lr_decay": "cosine", "warmup_steps": 1, "total_steps": 10},
            "export": {"dtype": "bf16"}, "executor": {"kind": "local", "options": {"threads_per_process": 1}}}
    for folder in ("specs", "prompts"):
        os.makedirs(f"{root}/{folder}")
    return {"root": root, "spec": spec}


@pytest.fixture(scope="module")
def actor(tmp_path_factory) -> str:
    """A published tiny actor (pipeline/toy.py), made and sharded in processes of their own: this
    one stays without torch."""
    root = tmp_path_factory.mktemp("actor")
    hf, ckpt = str(root / "hf"), str(root / "ckpt")
    subprocess.run([sys.executable, "-c", f"from llamarl.pipeline import toy; toy.make_llama({hf!r})"], check=True,
                   timeout=300)
    r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", "shard", hf, ckpt], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return ckpt


# ---- specs to `llamarl run SPEC --dry-run` ---------------------------------------------------------------------

# A billion values in nine lines: each alias is the list it names (each rollout.keep_columns item).
LAUGHS = "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else 'x'] * 9)}]\n" for i in range(9)) + \
    "rollout: {keep_columns: *a8}\n"
SPEC_FILES = {  # whole files that are no spec, and folders, missing files
    "missing": None, "folder": None, "empty": b"", "comments": b"# nothing here\n", "list": b"- name: fuzz\n",
    "scalar": b"fuzz\n", "null": b"~\n", "not-utf8": b"name: fuzz\xff\n", "nul": b"name: fu\x00zz\n",
    "tabs": b"name:\tfuzz\n\tstorage: x\n", "int-keys": b"1: 2\n3: [4]\n", "complex-key": b"? [a, b]\n: c\n",
    "python-tag": b"name: !!python/object:os.system x\n", "deep": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "laughs": LAUGHS.encode(), "itself": b"name: fuzz\nrollout: &r {keep_columns: [*r]}\n",
}


EXECUTORS = [{"kind": "local", "options": {"threads_per_process": 1, "max_concurrent_stages": 2}},
             {"kind": "slurm", "options": {"partition": "gpu", "timeout_min": 600, "gpus_per_node": 8,
                                           "additional": {"qos": "high"}, "setup": ["module load cuda"]}},
             {"kind": "kubernetes", "options": {"image": "llamarl:1", "pvc": "runs", "mount_path": "/tmp", "cpu": 32,
                                                "env": {"NCCL_DEBUG": "WARN"}, "node_selector": {"gpu": "h100"}}}]


def spec_case(world: dict, number: int) -> Case:
    rng = random.Random(f"spec:{SEED}:{number}")
    case = Case("spec", number, path=f"{world['root']}/specs/case-{number}.yaml")
    if rng.random() < 0.08:
        name = rng.choice(sorted(SPEC_FILES))
        case.what.append(f"the spec file: {name}")
        case.data = SPEC_FILES[name]
        if name == "folder":
            os.makedirs(case.path)
        elif case.data is not None:
            _write(case.path, case.data)
        return case
    tree = copy.deepcopy(world["spec"])
    tree["executor"] = rng.choice(EXECUTORS)
    if tree["executor"]["kind"] != "local":
        tree["layout"] = {**tree["layout"], "rollout": {"tp": 2, "dp": 2, "nodes": 2}}
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        tree, what = mutate(rng, tree)
        case.what.append(what)
    case.data = to_yaml(tree, rng)
    if rng.random() < 0.1:
        case.data, what = bend_bytes(rng, case.data)
        case.what.append(what)
    _write(case.path, case.data)
    return case


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("number", cases())
def test_a_mutated_spec_is_planned_or_refused_in_one_line(world, number):
    case = spec_case(world, number)
    launch = ["--show-launch"] if number % 4 == 0 else []  # what each stage would launch: the executors' renders
    result = invoke(["run", case.path, "--dry-run", *launch], case)
    ran_or_refused(result, case, [case.path, world["root"]])
    run_dir = f"{world['spec']['storage']}/{world['spec']['name']}"
    assert not os.path.exists(run_dir) and not os.path.exists(world["spec"]["metrics"]["tensorboard"]), \
        f"a dry run wrote:\n{case}"


# ---- prompts files to `llamarl stage rollout` -------------------------------------------------------------------

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
ODD_COLUMNS = {  # a column of the six rows in a type Parquet holds and a prompts reader may not expect
    "prompt": [pa.array(range(6)), pa.array([b"hi"] * 6, pa.binary()), pa.array(["hi"] * 6, pa.large_string()),
               pa.array(["hi", "yo"] * 3).dictionary_encode(), pa.array([["hi"]] * 6, pa.list_(pa.string())),
               pa.array([{"role": "user", "content": "hi"}] * 6), pa.array([[("user", "hi")]] * 6, pa.map_(pa.string(), pa.string())),
               pa.nulls(6), pa.array([1.5] * 6, pa.float16()), pa.array([[{"role": 1, "content": "hi"}]] * 6),
               pa.array([[{"role": "user", "content": "hi"}]] * 6, pa.large_list(MESSAGES.value_type)),
               pa.array([0] * 6, pa.timestamp("s")), pa.array(["🦙" * 3] * 6)],
    "id": [pa.array([float(i) for i in range(6)]), pa.array([2**64 - 1 - i for i in range(6)], pa.uint64()),
           pa.array([True, False] * 3), pa.array([[i] for i in range(6)]), pa.array([b"%d" % i for i in range(6)]),
           pa.array([str(i % 3) for i in range(6)]), pa.nulls(6, pa.string()), pa.array(range(6), pa.int8()),
           pa.array([f"{i}" for i in range(6)]).dictionary_encode(), pa.array([-(2**63) + i for i in range(6)])],
    "answer": [pa.array([{"k": 1}] * 6, pa.map_(pa.string(), pa.int64())), pa.array([1.5] * 6, pa.float16()),
               pa.array([1] * 6, pa.duration("s")), pa.array(["a", "b"] * 3).dictionary_encode(), pa.nulls(6),
               pa.array([[None]] * 6, pa.list_(pa.null())), pa.array([0] * 6, pa.time64("ns")),
               pa.array([b"ab"] * 6, pa.binary(2)), pa.array([0] * 6, pa.date32()),
               pa.array([{"x": {"y": [1.0, float("nan")]}}] * 6), pa.array([None] * 5 + [2**62])],
}
PROMPT_FILES = ["missing", "folder-empty", "folder-other", "folder-mixed", "folder-nested", "dir-named-jsonl", "empty",
                "blank-lines", "only-bom", "fifo", "csv", "not-parquet", "zero-rows", "duplicate-columns", "huge-line",
                "deep", "nan-literals"]


def prompts_case(folder: str, number: int) -> Case:
    """Prompts case ``number``, its files written in ``folder``."""
    rng = random.Random(f"prompts:{SEED}:{number}")
    case = Case("prompts", number, options=copy.deepcopy(OPTIONS))
    base = f"{folder}/case-{number}"
    if rng.random() < 0.12:
        return _odd_prompts_file(case, base, rng.choice(PROMPT_FILES))
    parquet, odd = rng.random() < 0.3, rng.random() < 0.4
    rows = PARQUET_ROWS if parquet else ROWS
    for _ in range(0 if parquet and odd else rng.choice([1, 1, 2, 3])):
        rows, what = mutate(rng, rows)
        case.what.append(what)
    if rng.random() < 0.15:
        columns = {k: case.options[k] for k in ("id_column", "keep_columns")} | {"prompt_column": "prompt"}
        columns, what = mutate(rng, columns, ("replace", "near", "delete", "duplicate"))
        case.options |= plain(columns) if isinstance(columns, dict) else {}
        case.what.append(f"options: {what}")
    if parquet:
        case.path = f"{base}.parquet"
        case.what.append("as Parquet")
        try:
            table = _odd_table(rng, case) if odd else pa.Table.from_pylist(plain(rows))
            pq.write_table(table, case.path, row_group_size=rng.choice([1, 4, 1024]))
        except (pa.ArrowException, AttributeError, TypeError, ValueError, OverflowError) as e:  # no Parquet: JSON lines
            case.what.append(f"not Parquet ({type(e).__name__}), JSON lines instead")
        else:
            return case
    case.path = f"{base}.jsonl"
    case.data = "".join(to_json(r) + "\n" for r in rows).encode()
    if rng.random() < 0.3:
        case.data, what = bend_bytes(rng, case.data)
        case.what.append(what)
    _write(case.path, case.data)
    return case


def _odd_table(rng: random.Random, case: Case) -> pa.Table:
    columns = {name: pa.array([r[name] for r in PARQUET_ROWS]) for name in ("prompt", "id", "answer")}
    name = rng.choice(sorted(ODD_COLUMNS))
    columns[name] = rng.choice(ODD_COLUMNS[name])
    case.what.append(f"column {name!r} of type {columns[name].type}")
    return pa.table(columns)


def _odd_prompts_file(case: Case, base: str, kind: str) -> Case:
    """A prompts path that is no plain file of good rows: ``kind`` of ``PROMPT_FILES``."""
    case.what.append(f"the prompts file: {kind}")
    good = "".join(to_json(r) + "\n" for r in ROWS).encode()
    case.path = f"{base}.jsonl"
    if kind in ("folder-empty", "folder-other", "folder-mixed", "folder-nested", "dir-named-jsonl"):
        case.path = base if kind != "dir-named-jsonl" else case.path
        os.makedirs(f"{case.path}/inner")
        files = {"folder-other": {"a.txt": good}, "folder-mixed": {"a.jsonl": good, "b.parquet": b"PAR1"},
                 "folder-nested": {"inner/a.jsonl": good, "b.jsonl": good}}.get(kind, {})
        for name, data in files.items():
            _write(f"{case.path}/{name}", data)
    elif kind == "fifo":
        os.mkfifo(case.path)
    elif kind in ("csv", "not-parquet"):
        case.path = f"{base}.{'csv' if kind == 'csv' else 'parquet'}"
        _write(case.path, b"prompt,id\nhi,1\n" if kind == "csv" else good)
    elif kind in ("zero-rows", "duplicate-columns"):
        case.path = f"{base}.parquet"
        table = pa.table({"prompt": pa.array([], pa.string()), "id": pa.array([], pa.string())}) if kind == "zero-rows" \
            else pa.Table.from_arrays([pa.array(["hi"] * 2), pa.array(["a", "b"]), pa.array(["yo"] * 2)],
                                      names=["prompt", "id", "prompt"])
        pq.write_table(table, case.path)
    elif kind != "missing":
        case.data = {"empty": b"", "blank-lines": b"\n \n\t\n", "only-bom": b"\xef\xbb\xbf",
                     "huge-line": to_json({"prompt": "word " * 400_000, "id": "a", "answer": "x"}).encode() + b"\n",
                     "deep": b'{"prompt": "hi", "id": "a", "answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
                     "nan-literals": b'{"prompt": "hi", "id": "a", "answer": NaN}\n{"prompt": "yo", "id": "b", '
                                     b'"answer": Infinity}\n'}[kind]
        _write(case.path, case.data)
    return case


def launch(actor: str, folder: str, number: int, monkeypatch) -> tuple[Case, str, str]:
    """Prompts case ``number`` (written in ``folder``) to ``llamarl stage rollout`` with its
    processes not started: (the case, its output folder, its options file) if the launcher
    accepted it, None if it refused it in one line."""
    case = prompts_case(folder, number)
    out, options = f"{folder}/out-{number}", f"{folder}/options-{number}.yaml"
    _write(options, yaml.safe_dump(case.options).encode())
    started = []
    monkeypatch.setattr(cli, "_run_local", lambda stage, config, made: started.append(config))
    result = invoke(["stage", "rollout", actor, case.path, out, "--config", options], case)
    # A check across the options and the command line names the option alone (tests/test_config.py).
    accepted = ran_or_refused(result, case, [case.path, options, *(f"{k}=" for k in case.options)])
    assert len(started) == accepted, f"{'accepted' if accepted else 'refused'}, {len(started)} rollouts started:\n{case}"
    assert not os.path.exists(out), f"the launcher wrote {out}:\n{case}"
    return (case, out, options) if accepted else None


@pytest.mark.parametrize("number", cases())
def test_a_mutated_prompts_file_is_rolled_out_or_refused_in_one_line(world, actor, number, monkeypatch):
    launch(actor, f"{world['root']}/prompts", number, monkeypatch)


def test_the_rollout_command_refuses_bad_prompts_before_any_process_starts(actor, tmp_path):
    # Each rank imports torch (seconds) before it can refuse a row: the launcher refuses it, torch-free.
    bad = _jsonl(str(tmp_path / "p.jsonl"), [{"prompt": "hi"}, {"prompt": None}])
    code = ("import sys\nfrom llamarl.pipeline.cli import app\ntry:\n    app(['stage', 'rollout', *sys.argv[1:]])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, actor, bad, str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split() == ["2", "False"] and r.stderr == f"error: {bad}: line 2 (row 1): 'prompt' is null; give " \
                                                              "every row a prompt: text, or chat messages [{role, " \
                                                              "content}, ...]\n", r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_what_the_launcher_accepts_the_rollout_rolls_out(actor, tmp_path, monkeypatch):
    accepted = [found for number in cases()
                if (found := launch(actor, str(tmp_path), number, monkeypatch)) is not None]
    monkeypatch.undo()
    first = {}  # the first accepted case of each format
    for found in accepted:
        first.setdefault(found[0].path.rsplit(".", 1)[-1], found)
    assert set(first) == {"jsonl", "parquet"}, [c.what for c, _, _ in accepted]
    rolled_out, refused = [], []
    for case, out, options in accepted if REAL == "all" else list(first.values())[:REAL_ROLLOUTS]:
        r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", "rollout", actor, case.path, out,
                            "--config", options], capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 0 or (r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")), \
            f"exit status {r.returncode}:\n{r.stderr[-5000:]}\n{case}"
        if r.returncode == 0:  # every row, every sample
            manifest = publish.require_published(out, contract.ROLLOUT)
            rows = prompts.check_dataset(case.path, prompts.Columns.of(RolloutConfig.parse(
                {"actor": actor, "prompts": case.path, "out": out} | case.options, "options"))).rows
            assert manifest["rows"] == rows * case.options["sampling"]["samples_per_prompt"], case
            rolled_out.append(case.number)
        else:  # what only the stage knows (the tokenizer's chat template refusing a role, …)
            refused.append((case.number, lines[0]))
    print(f"\n{len(accepted)} of {len(cases())} prompts cases accepted by the launcher; rolled out for real: "
          f"{rolled_out}; refused by the stage: {refused}")
    assert rolled_out, refused
