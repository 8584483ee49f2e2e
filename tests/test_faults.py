"""Fault injection, one matrix: every artifact a stage reads × every fault × every stage reading it.

Each case damages a copy of a good artifact, runs the consuming stage as a real process, and
expects what a user must see: exit status 2, one line (``error: …`` naming the file and the fix), and
nothing published. Faults: a file missing, truncated, bytes flipped in the middle, bytes flipped at
the end (Parquet footer, DCP tail), a same-named file from another run, the directory left
unfinished, and the manifest damaged.

HF source checkpoints carry no checksums: a flipped byte inside a tensor, or a tensor file swapped
for another model's of the same shapes, is valid data to shard and cannot be detected there; what
can be (a missing or truncated file, a damaged header) is tested below. ppo's saved training state
(read when a killed ppo resumes) has its own cases at the end: its done marker is its manifest, and
"unfinished" there is the normal state of a step being saved (the resume takes the previous one).
So has the training state a finished ppo publishes beside each role's weights
(``OUT/train_state/<role>``, read by the next ppo only): every fault, and two of its own (absent
altogether, or whole but another run's).

Numbers, last: a rule whose score ppo cannot train on (±1e30, nan, an int beyond any float) is
refused by score; scores beyond that bound written by hand are refused by ppo; and a ppo whose
optimizer step goes non-finite stops at that step, publishing nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from llamarl.lib.files import publish
from llamarl.pipeline import toy
from llamarl.stages import ppo, rollout, score, shard
from llamarl.stages.config import PPOConfig, RewardTerm, RolloutConfig, Sampling, ScoreConfig, ShardConfig

pytestmark = pytest.mark.slow

FAULTS = ["missing", "truncated", "flipped_middle", "flipped_end", "other_run", "unfinished", "manifest"]
RULE = "llamarl.pipeline.demo:vowel_ratio"


@pytest.fixture(scope="module")
def good(tmp_path_factory, pool1):
    """Two of everything (the second for "another run's file"), made once."""
    root = tmp_path_factory.mktemp("faults")
    prompts = toy.make_prompts(str(root / "prompts.jsonl"), n=4)
    out = {"prompts": prompts}
    for tag, seed in (("", 0), ("other_", 1)):
        toy.make_llama(str(root / f"{tag}actor_hf"), seed=seed)
        toy.make_llama(str(root / f"{tag}rm_hf"), kind="score", seed=seed + 10, tokenizer_corpus=toy.CORPUS_B)
        for name in ("actor", "rm"):
            pool1.run(shard.run, ShardConfig(src=str(root / f"{tag}{name}_hf"), dst=str(root / f"{tag}{name}")))
        pool1.run(rollout.run, RolloutConfig(
            actor=str(root / f"{tag}actor"), prompts=prompts, out=str(root / f"{tag}rollout"), id_column="id",
            sampling=Sampling(samples_per_prompt=2, max_new_tokens=6, seed=seed)))
        pool1.run(score.run, ScoreConfig(rollout=str(root / f"{tag}rollout"), out=str(root / f"{tag}scores"),
                                               rewards=[RewardTerm(name=RULE)]))
        for name in ("actor_hf", "rm_hf", "actor", "rm", "rollout", "scores"):
            out[f"{tag}{name}"] = str(root / f"{tag}{name}")
    return out


def _target(artifact: str) -> str:
    """The data file a fault hits, relative to the artifact's folder."""
    return {"checkpoint": "model/__0_0.distcp", "rm": "model/__0_0.distcp", "rollout": "parts/part-000000.parquet",
            "scores": "parts/part-000000.parquet"}[artifact]


def _damage(src: str, other: str, dst: str, fault: str, rel: str, published: str = "") -> None:
    """A copy of ``src`` at ``dst`` with ``fault``: at its file ``rel``, or at the manifest of its
    published folder ``published`` (itself, by default)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, rel)
    dst = os.path.join(dst, published)
    if fault == "missing":
        os.remove(path)
    elif fault == "truncated":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif fault in ("flipped_middle", "flipped_end"):
        data = bytearray(open(path, "rb").read())
        at = len(data) // 2 if fault == "flipped_middle" else len(data) - 16
        data[at : at + 16] = bytes(b ^ 0x5A for b in data[at : at + 16])
        open(path, "wb").write(bytes(data))
    elif fault == "other_run":
        shutil.copyfile(os.path.join(other, rel), path)
    elif fault == "unfinished":
        os.remove(os.path.join(dst, publish.MANIFEST))
        open(os.path.join(dst, publish.INCOMPLETE), "w").close()
    elif fault == "manifest":
        data = open(os.path.join(dst, publish.MANIFEST), "rb").read()
        open(os.path.join(dst, publish.MANIFEST), "wb").write(data[: len(data) // 2])


def _consumers(g: dict, artifact: str, damaged: str, out: str) -> dict[str, tuple[str, dict]]:
    """The stages that read ``artifact``, each given the damaged copy."""
    ppo = {"rollout": g["rollout"], "scores": g["scores"], "actor": g["actor"], "out": out}
    if artifact == "checkpoint":
        return {"rollout": ("rollout", {"actor": damaged, "prompts": g["prompts"], "out": out,
                                        "sampling": {"max_new_tokens": 4}}),
                "ppo": ("ppo", ppo | {"actor": damaged}),
                "export": ("export", {"src": damaged, "dst": out})}
    if artifact == "rm":
        return {"score": ("score", {"rollout": g["rollout"], "out": out, "reward_model": damaged,
                                    "rewards": [{"name": "rm"}]})}
    if artifact == "rollout":
        return {"score": ("score", {"rollout": damaged, "out": out, "rewards": [{"name": RULE}]}),
                "ppo": ("ppo", ppo | {"rollout": damaged})}
    return {"ppo": ("ppo", ppo | {"scores": damaged})}


def _run(stage: str, cfg: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # one process, started by hand
    return subprocess.run([sys.executable, "-m", f"llamarl.stages.{stage}", "--config-json", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=300, env=env)


def _refused(r: subprocess.CompletedProcess, out: str, what: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"{what}:\n{r.stderr[-3000:]}"
    assert publish.read_manifest(out) is None, f"{what}: something was published"


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("artifact", ["checkpoint", "rm", "rollout", "scores"])
def test_every_reader_refuses_every_fault(good, tmp_path, artifact, fault):
    src = good["actor" if artifact == "checkpoint" else artifact]
    other = good["other_" + ("actor" if artifact == "checkpoint" else artifact)]
    damaged = str(tmp_path / "damaged")
    _damage(src, other, damaged, fault, _target(artifact))
    for name, (stage, cfg) in _consumers(good, artifact, damaged, str(tmp_path / "out")).items():
        out = cfg.get("out") or cfg["dst"]
        _refused(_run(stage, cfg), out, f"{artifact}/{fault} read by {name}")
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("fault", ["missing", "truncated", "header"])
def test_shard_refuses_a_damaged_hf_checkpoint(good, tmp_path, fault):
    src = str(tmp_path / "hf")
    shutil.copytree(good["actor_hf"], src)
    path = os.path.join(src, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    if fault == "missing":
        os.remove(path)
    elif fault == "truncated":
        open(path, "wb").write(bytes(data[: len(data) // 2]))
    else:  # the JSON header after the 8-byte length
        data[8:24] = b"\x00" * 16
        open(path, "wb").write(bytes(data))
    out = str(tmp_path / "out")
    _refused(_run("shard", {"src": src, "dst": out}), out, f"HF source/{fault} read by shard")


# ---- ppo's saved training state (read when a killed ppo resumes) ---------------------------------------


@pytest.fixture(scope="module")
def killed_ppo(good, tmp_path_factory):
    """A ppo output killed after its training state of step 2 (or later) was saved."""
    import signal
    import time

    out = tmp_path_factory.mktemp("killed") / "ppo"
    cfg = {"rollout": good["rollout"], "scores": good["scores"], "actor": good["actor"], "out": str(out),
           "mini_batch_size": 2, "micro_batch_tokens": 64, "ppo_epochs": 2, "save_every": 1}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.stages.ppo", "--config-json", json.dumps(cfg)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out / ".state" / "step-000002" / "done.json").exists():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / ".state" / "step-000002" / "done.json").exists()
    return out, cfg


@pytest.mark.parametrize("fault", ["missing", "truncated", "flipped_middle", "flipped_end", "other_run", "manifest"])
def test_ppo_refuses_a_damaged_training_state(killed_ppo, tmp_path, fault):
    src, cfg = killed_ppo
    out = tmp_path / "ppo"
    shutil.copytree(src, out)
    steps = sorted(p for p in (out / ".state").iterdir() if (p / "done.json").exists())
    newest, older = steps[-1], steps[0]
    rel = os.path.relpath(sorted((newest / "actor" / "optim").glob("*.distcp"))[0], newest)
    if fault == "manifest":  # the done marker, the state's manifest
        marker = newest / "done.json"
        marker.write_bytes(marker.read_bytes()[:20])
    else:  # "other_run": the same-named file of another (earlier) saved state
        os.rename(newest, tmp_path / "newest")
        _damage(str(tmp_path / "newest"), str(older), str(newest), fault, rel)
    _refused(_run("ppo", cfg | {"out": str(out)}), str(out), f"training state/{fault} read by ppo")


@pytest.fixture(scope="module")
def trained(good, tmp_path_factory, pool1):
    """Two finished ppo outputs (the second for "another run's file"), each with its train_state/."""
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for tag in ("", "other_"):
        out[tag] = str(root / f"{tag}ppo")
        pool1.run(ppo.run, PPOConfig(rollout=good[f"{tag}rollout"], scores=good[f"{tag}scores"], actor=good[f"{tag}actor"],
                                     out=out[tag], mini_batch_size=4, micro_batch_tokens=64, ppo_epochs=1))
    return out


@pytest.mark.parametrize("fault", FAULTS + ["absent", "swapped"])
def test_the_next_ppo_refuses_a_damaged_train_state(good, trained, tmp_path, fault):
    state = "train_state/actor"
    damaged = str(tmp_path / "ppo")
    if fault == "absent":  # the checkpoint copied without it
        shutil.copytree(trained[""], damaged)
        shutil.rmtree(os.path.join(damaged, state))
    elif fault == "swapped":  # whole and sound, but another run's: not of these weights
        shutil.copytree(trained[""], damaged)
        shutil.rmtree(os.path.join(damaged, state))
        shutil.copytree(os.path.join(trained["other_"], state), os.path.join(damaged, state))
    else:
        _damage(trained[""], trained["other_"], damaged, fault, f"{state}/optim/__0_0.distcp", published=state)
    out = str(tmp_path / "out")
    cfg = {"rollout": good["rollout"], "scores": good["scores"], "actor": f"{damaged}/actor", "critic": f"{damaged}/critic",
           "reference": good["actor"], "off_policy": True, "out": out}
    r = _run("ppo", cfg)
    _refused(r, out, f"train state/{fault} read by ppo")
    assert f"{damaged}/{state}" in r.stderr


def test_rollout_and_export_read_only_the_weights(good, trained, tmp_path):
    damaged = str(tmp_path / "ppo")
    shutil.copytree(trained[""], damaged)
    shutil.rmtree(os.path.join(damaged, "train_state"))
    for stage, cfg, out in (
            ("rollout", {"actor": f"{damaged}/actor", "prompts": good["prompts"], "out": str(tmp_path / "r"),
                         "sampling": {"max_new_tokens": 4}}, "r"),
            ("export", {"src": f"{damaged}/actor", "dst": str(tmp_path / "e")}, "e")):
        r = _run(stage, cfg)
        assert r.returncode == 0 and publish.read_manifest(str(tmp_path / out)), (stage, r.stderr[-2000:])


@pytest.mark.parametrize("rule,needle", [
    ("raises", "failed on"), ("returns_none", "a rule returns a number"), ("reads_absent_column", "reads column"),
    # numbers ppo cannot train on: beyond its bound, not finite, beyond any float
    ("huge", "is -1e+30, beyond ±1e+06, where ppo's float32 arithmetic overflows"),
    ("nan_rule", "scored ('p0000', 0) nan: a score must be a finite number that float32 holds"),
    ("huge_int", "scored ('p0000', 0) inf: a score must be a finite number")])
def test_score_refuses_a_failing_rule_in_one_line(good, tmp_path, rule, needle):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    out = str(tmp_path / "scores")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"PYTHONPATH": tests_dir}
    r = subprocess.run([sys.executable, "-m", "llamarl.stages.score", "--config-json",
                        json.dumps({"rollout": good["rollout"], "out": out, "rewards": [{"name": f"rules_for_tests:{rule}"}]})],
                       capture_output=True, text=True, timeout=300, env=env)
    _refused(r, out, f"rule {rule}")
    assert f"rule 'rules_for_tests:{rule}'" in r.stderr and "/parts/part-000000.parquet" in r.stderr
    assert "('p0000', 0)" in r.stderr and needle in r.stderr, r.stderr  # the row, and what is wrong


def _forged_scores(src: str, dst: str, value: float) -> None:
    """A published copy of the scores ``src`` whose every score is ±``value``, checksums and all: what
    a scores output written by hand, or by a score from before the bound, can hold."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(src, dst)
    part = os.path.join(dst, "parts", "part-000000.parquet")
    table = pq.read_table(part)
    forged = pa.array([value * (-1) ** i for i in range(table.num_rows)], pa.float32())
    pq.write_table(table.set_column(table.schema.get_field_index("score"), "score", forged), part)
    manifest = json.load(open(os.path.join(dst, publish.MANIFEST)))
    manifest["files"]["parts/part-000000.parquet"] = publish.file_entry(part)
    json.dump(manifest, open(os.path.join(dst, publish.MANIFEST), "w"))


def test_ppo_refuses_scores_beyond_what_it_can_train_on(good, tmp_path):
    scores = str(tmp_path / "scores")
    _forged_scores(good["scores"], scores, 1e30)
    out = str(tmp_path / "ppo")
    r = _run("ppo", {"rollout": good["rollout"], "scores": scores, "actor": good["actor"], "out": out})
    _refused(r, out, "scores of ±1e30 read by ppo")
    assert f"{scores}: the score of ('p0000', 0) is 1e+30, beyond ±1e+06" in r.stderr, r.stderr


def _ppo_with_lr_at(good, out, at: int, lr: str, **cfg) -> subprocess.CompletedProcess:
    """ppo (4 steps of 2 samples) in a process of its own, its learning rate set to ``lr`` before
    step ``at`` by the stage's test hook."""
    cfg = {"rollout": good["rollout"], "scores": good["scores"], "actor": good["actor"], "out": str(out),
           "mini_batch_size": 2, "micro_batch_tokens": 64, **cfg}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {
        "LLAMARL_TEST_PPO_AT": f"step {at}:lr={lr}"}
    return subprocess.run([sys.executable, "-m", "llamarl.stages.ppo", "--config-json", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("lr,at,needle", [
    ("inf", 3, "actor masters not finite"), ("nan", 3, "actor masters not finite"),
    # finite masters of 1e30 pass step 2's check; step 3's forward overflows
    ("1e30", 2, "policy loss not finite")])
def test_a_non_finite_step_stops_ppo_and_publishes_nothing(good, tmp_path, lr, at, needle):
    # A learning rate no config can give, set by the test hook before step ``at``, makes the step
    # non-finite; its check stops every process there, before anything is published. The training
    # state saved after each step before stays, unpublished.
    out = tmp_path / "ppo"
    r = _ppo_with_lr_at(good, out, at, lr, save_every=1)
    _refused(r, str(out), f"lr={lr} at step {at}")
    assert r.stderr.startswith(f"error: ppo optimizer step 3: {needle}"), r.stderr
    assert f"(actor_lr=1e-06, now {float(lr):g})" in r.stderr and "nothing was published" in r.stderr, r.stderr
    assert sorted(os.listdir(out)) == sorted([publish.INCOMPLETE, ".state"])  # no weights, training state or metrics
    assert sorted(os.listdir(out / ".state")) == ["step-000001", "step-000002"]


@pytest.mark.parametrize("at", [3, 4])
def test_a_step_read_after_the_next_is_launched_still_stops_ppo_before_it_publishes(good, tmp_path, at):
    # Without saved states between steps, ppo reads step N's check once step N+1 is launched (4
    # steps here); the last step is read before anything is written. Either way the error names
    # step N and nothing is published.
    out = tmp_path / "ppo"
    r = _ppo_with_lr_at(good, out, at, "nan")
    _refused(r, str(out), f"lr=nan at step {at}")
    assert r.stderr.startswith(f"error: ppo optimizer step {at}: actor masters not finite"), r.stderr
    assert sorted(os.listdir(out)) == [publish.INCOMPLETE]
