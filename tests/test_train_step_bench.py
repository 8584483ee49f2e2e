"""bench/train_step.py at TP / PP under torchrun: the 8B goals' runs, smoke-tested small on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *layout):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "bench", "train_step.py"), "--small", *layout, "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def _check(res, tp, pp, sp, micro_batches):
    assert res["gpus"] == 2 and res["layout"] == {"tp": tp, "pp": pp, "sequence_parallel": sp,
                                                  "micro_batches": micro_batches}
    lib = res["llamarl"]
    assert lib["tok_s"] > 0 and lib["mfu"] > 0 and lib["tok_s_per_gpu"] == pytest.approx(lib["tok_s"] / 2)
    assert len(lib["peak_gb_per_rank"]) == 2 and [r["rank"] for r in lib["ranks"]] == [0, 1]
    # Every rank holds its own part of the model; the loss lives on the last stage.
    assert all(r["params"] > 0 for r in lib["ranks"])
    last = [r for r in lib["ranks"] if r["pp_rank"] == pp - 1]
    assert all(len(r["first_losses"]) == 3 and all(x == x for x in r["first_losses"]) for r in last)
    return lib


def test_train_step_bench_pp2_on_cpu(tmp_path):
    lib = _check(_run(tmp_path, "--pp", "2"), 1, 2, False, 2)
    assert lib["pp_bubble_1f1b"] == pytest.approx(1 / 3)  # (pp - 1) / (m + pp - 1), m = 2 sequences
    assert lib["pp_bubble_measured_per_rank"] is None  # measured from a GPU trace only
    assert sorted(r["pp_rank"] for r in lib["ranks"]) == [0, 1]


@pytest.mark.slow
def test_train_step_bench_tp2_sp_on_cpu(tmp_path):
    lib = _check(_run(tmp_path, "--tp", "2", "--sp"), 2, 1, True, 1)
    assert "pp_bubble_1f1b" not in lib
    assert sorted(r["tp_rank"] for r in lib["ranks"]) == [0, 1]


def test_the_ppo_update_profiles_through_its_scopes_on_cpu(tmp_path):
    """``--ppo --profile`` wraps the trainer's pieces in ``record_function`` scopes by their names:
    a renamed function fails the variant (recorded, not raised), which this test sees."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_step.py"), "--small", "--ppo",
                        "--ppo-cases", "ppo", "--skip-hf", "--steps", "2", "--profile", str(tmp_path),
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("llamarl", "ppo"):
        assert "error" not in res[name], res[name].get("traceback")
        assert "rl loss (fwd)" in res[name]["profile"]["ms"]
    assert res["ratio_ppo_over_llamarl"] > 0
