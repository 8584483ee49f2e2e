"""bench/report.py renders what the bench scripts write (fast: synthetic results files)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import report  # noqa: E402


def _engine(tok_s, seconds, drain_s, drain_slot_steps, slots=8):
    return {"engine_slots": slots, "new_tok_s": tok_s, "seconds": seconds, "tokens": int(tok_s * seconds),
            "mean_len": 10.0, "steps": 40, "slot_steps": 320, "drain_s": drain_s, "drain_steps": 12,
            "drain_slot_steps": drain_slot_steps, "drain_fraction_of_time": drain_s / seconds}


def test_rollout_renders_the_multi_gpu_and_drain_fields(tmp_path):
    r = {"date": "2026-11-25", "device": "cpu", "gpus": 0, "backend": "gloo", "prompt_len": 16, "new_tokens": 16,
         "sampling": "temperature 1, top_p 1",
         "parallel": {"tp": 1, "dp": 2, "prompts": 32, "chunk": 4, "max_batch": 4, "engine": "batch_invariant"},
         "one_gpu": {"new_tok_s": 2000.0, "seconds": 0.25, "tokens": 512},
         "tp1_dp2": {"new_tok_s": 3800.0, "seconds": 0.135, "tokens": 512, "speedup_over_one_gpu": 1.9,
                     "efficiency": 0.95, "same_tokens_as_one_gpu": 1.0},
         "drain": {"stop_tokens": 40, "chunk": 4, "new_tokens": 16,
                   "4": {"slots": 4, "prompts": 16, "batch_invariant": _engine(300.0, 0.6, 0.14, 120),
                         "default": _engine(450.0, 0.4, 0.07, 40, slots=4), "invariant_over_default_tok_s": 0.667,
                         "extra_s": 0.2, "extra_drain_s": 0.07}}}
    path = tmp_path / "rollout-cpu-x.json"
    path.write_text(json.dumps(r))
    text = "\n".join(report.rollout(str(path)))
    assert "| batch |" not in text  # no fixed-length workload in this file: no empty table
    assert "| one device (TP1) | 2,000 | 0.25 | 512 | 1.00× | | |" in text
    assert "| TP1 × DP2 | 3,800 | 0.14 | 512 | **1.90×** | 95% | 1.00 |" in text
    assert "| 8 | 16 | 300 | 450 | **0.67** | 0.20 | 0.14 / 0.07 | 120 / 40 |" in text
    # a layout run cut off before its row: said so, not a crash
    del r["tp1_dp2"]
    path.write_text(json.dumps(r))
    assert "not in the file" in "\n".join(report.rollout(str(path)))


def test_rollout_stage_renders_wall_over_engine_and_a_failed_run(tmp_path):
    run = {"name": "p16-r0", "rc": 0, "prompts": 16, "caches": "cold", "command_wall_s": 6.0, "engine_s": 4.0,
           "new_tokens": 1019, "rows": 64, "engine_tok_s": 255, "process_wall_s": 5.0, "command_wall_over_engine": 1.5,
           "process_wall_over_engine": 1.25,
           "spans_s": {"imports": 2.0, "build": 0.25, "load": 0.5, "tokenizer_wait": 0.1, "compile_wait": 0.0,
                       "first_tokens": 0.3}}
    r = {"date": "2026-11-25", "device": {"name": "cpu", "count": 0}, "runs": [run, {"prompts": 32, "caches": "warm", "rc": 1}],
         "workload": {"samples": 4, "max_new_tokens": 16, "chunk_size": 8, "max_batch": 32}}
    path = tmp_path / "rollout_stage-cpu-x.json"
    path.write_text(json.dumps(r))
    lines = report.RENDER["rollout_stage"](str(path))
    assert "| 16 | cold | 1,019 | 4.00 | 255 | 5.00 | **1.25×** | 1.50× | 2.00 | 0.75 | 0.10, 0.00 | 0.30 |" in lines
    assert "| 32 | warm | failed (rc 1) | | | | | | | | | |" in lines
