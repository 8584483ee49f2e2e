"""Overlapped iterations resume like sequential ones: a `llamarl run` with max_staleness 1 and two
stages at once, killed with its stage processes at seeded random moments (while the first two
rollouts run, while a ppo trains beside the next rollout, then anywhere) and rerun to the end,
publishes the same last actor and critic, metrics and export, bit for bit, as a run never killed."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest
import yaml
from safetensors.torch import load_file
from test_overlap import _spec
from test_pipeline import _cli, _records, rerun_redoing_nothing_finished

from llamarl.pipeline import demo
from llamarl.pipeline.dag import load_spec

pytestmark = pytest.mark.slow

SEED = 18
# The demo's models and prompts on the overlap placement (one process a stage, two stages at once),
# scored by the rule alone (no reward model to shard): 3 iterations, so rollouts 1 and 2 run side by
# side and rollout 3 beside ppo 2.
SMALL = dict(iterations=3, reward_model=None, layout=demo.OVERLAP_LAYOUT, executor=demo.OVERLAP_EXECUTOR,
             score={"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0}]})


def _running(run_dir: str) -> list[str]:
    return sorted(name.removesuffix(".json") for name, r in _records(run_dir).items() if r.get("status") == "running")


def _longest_overlap_s(run_dir: str, a: str, b: str) -> float:
    """The longest time a stage ``a`` (ppo) and a stage ``b`` (rollout) ran at once in a finished
    run, from its records' start and finish times."""
    def span(r):
        return tuple(datetime.fromisoformat(r[k].replace("Z", "+00:00")).timestamp() for k in ("started", "finished"))
    spans = [(name.split(".")[-2], span(r)) for name, r in _records(run_dir).items() if r.get("started")]
    return max((min(x[1], y[1]) - max(x[0], y[0]) for sx, x in spans if sx == a for sy, y in spans if sy == b),
               default=0.0)


def _run_killed(spec: str, run_dir: str, after: int, delay: float, beside: str | None) -> tuple[list[str], list[str]]:
    """`llamarl run SPEC` killed with its whole process group ``delay`` seconds after it started
    its ``after``-th stage — with ``beside``, after a stage started beside another on a line that
    matches it, at the first moment after that when two stages are running. Returns the stages it
    had started and those recorded running when it was killed; ([], []) if it ended first."""
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    started, seen = [], threading.Condition()

    def read():
        for line in proc.stdout:
            m = re.match(r"\[(\S+)\] running ", line)
            with seen:
                if m:
                    started.append((m.group(1), line))
                seen.notify_all()
        with seen:
            started.append(None)  # the run's output ended
            seen.notify_all()

    threading.Thread(target=read, daemon=True).start()
    with seen:
        seen.wait_for(lambda: None in started or len(started) >= after and (
            beside is None or any("(beside" in line and re.search(beside, line) for _, line in started)), timeout=600)
    time.sleep(delay)
    while beside is not None and proc.poll() is None and len(_running(run_dir)) < 2:
        time.sleep(0.02)
    with seen:
        if proc.poll() is not None or None in started:
            return [], []
        names, running = [name for name, _ in started], _running(run_dir)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return names, running


def _files(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` but the manifests (which hold their creation time) and DCP's
    ``.metadata`` (the checkpoint's path and a random save id; the tensors are in the other files)."""
    out = {}
    for d, _, names in os.walk(folder):
        for name in names:
            if name not in ("llamarl.json", ".metadata"):
                path = os.path.join(d, name)
                out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def _metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_overlapped_run_killed_at_random_moments_then_rerun_gives_the_same_bytes(tmp_path):
    reference = _spec(tmp_path, 1, **SMALL)
    data = yaml.safe_load(open(reference))
    data["name"] = "killed"
    killed = tmp_path / "killed.yaml"
    killed.write_text(yaml.safe_dump(data))
    ref_dir, killed_dir = load_spec(reference).run_dir, load_spec(str(killed)).run_dir

    t0 = time.monotonic()
    proc = _cli("run", reference)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(beside" in proc.stdout
    whole = time.monotonic() - t0
    # The one ppo beside a rollout (ppo 2, rollout 3) lasts about a second: kill 2's moment is a
    # seeded share of that, not of a fixed span that can outlast it (then the kill would land
    # wherever two stages next run at once, or nowhere: the run may end first).
    beside_s = _longest_overlap_s(ref_dir, "ppo", "rollout")
    assert beside_s > 0, "no ppo ran beside a rollout in the uninterrupted run"

    rng = random.Random(SEED)
    # (after the run's n-th stage start, seconds after it, on a stage started beside another like
    # this): while the first two rollouts run; while a ppo trains beside the next rollout; anywhere.
    plan = [(1, rng.uniform(0.0, 1.5), ""), (1, rng.uniform(0.0, 0.5) * beside_s, r"ppo.*beside.*rollout|rollout.*beside.*ppo"),
            (rng.randint(1, 3), rng.uniform(0.5, 3.0), None)]
    hits, stages = [], len(_records(ref_dir))
    for kill, (n, delay, beside) in enumerate(plan, 1):
        # A kill that landed late (the moment two stages run may come only at the export) leaves
        # few stages to start: the n-th start is then one that is not the run's last.
        done = _records(killed_dir) if os.path.isdir(os.path.join(killed_dir, "pipeline")) else {}
        left = stages - sum(r.get("status") == "done" for r in done.values())
        started, running = _run_killed(str(killed), killed_dir, min(n, max(1, left - 1)), delay, beside)
        assert started, f"the run ended before kill {kill}: {hits}"
        assert beside is None or len(running) >= 2, running
        assert kill != 2 or {r.split(".")[-1] for r in running} >= {"ppo", "rollout"}, running
        hits.append((started[-1], running))
    print(f"uninterrupted run {whole:.0f} s; killed (last stage started, stages running): {hits}")
    rerun_redoing_nothing_finished(str(killed), killed_dir)

    last = os.path.join("iter-003", "ppo")
    for part in ("actor", "critic"):
        a, b = _files(os.path.join(ref_dir, last, part)), _files(os.path.join(killed_dir, last, part))
        assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a), (part, hits)
    assert _metrics(os.path.join(ref_dir, last, "metrics.jsonl")) == _metrics(os.path.join(killed_dir, last, "metrics.jsonl"))
    assert _metrics(os.path.join(ref_dir, "metrics.jsonl")) == _metrics(os.path.join(killed_dir, "metrics.jsonl"))
    a = load_file(os.path.join(ref_dir, "export", "model.safetensors"))
    b = load_file(os.path.join(killed_dir, "export", "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and (a[k] == b[k]).all() for k in a), hits
