"""bench/report.py and bench/tables.py: docs/benchmarks.md is what they make of bench/results, and they
render what the bench scripts write (fast: the committed results and synthetic files)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import report  # noqa: E402
import tables  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    text = "\n".join(tables.rollout(str(path)))
    assert "| batch |" not in text  # no fixed-length workload in this file: no empty table
    assert "| one device (TP1) | 2,000 | 0.25 | 512 | 1.00× | | |" in text
    assert "| TP1 × DP2 | 3,800 | 0.14 | 512 | **1.90×** | 95% | 1.00 |" in text
    assert "| 8 | 16 | 300 | 450 | **0.67** | 0.20 | 0.14 / 0.07 | 120 / 40 |" in text
    # a layout run cut off before its row: said so, not a crash
    del r["tp1_dp2"]
    path.write_text(json.dumps(r))
    assert "not in the file" in "\n".join(tables.rollout(str(path)))


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
    lines = tables.RENDER["rollout_stage"](str(path))
    assert "| 16 | cold | 1,019 | 4.00 | 255 | 5.00 | **1.25×** | 1.50× | 2.00 | 0.75 | 0.10, 0.00 | 0.30 |" in lines
    assert "| 32 | warm | failed (rc 1) | | | | | | | | | |" in lines


def test_docs_benchmarks_md_is_what_report_py_makes_of_the_committed_results():
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    begin, end = doc.index(report.BEGIN), doc.index(report.END) + len(report.END) + 1
    assert doc[begin:end] == report.generate(), (
        "docs/benchmarks.md differs from bench/results: run `python bench/report.py --write` and commit it")


def test_every_results_file_of_a_known_bench_renders():
    found, others = report.results()
    assert found and all(f.bench in tables.RENDER for f in found)
    for f in found:
        assert f"`{f.name}`" in "\n".join(tables.RENDER[f.bench](f.path)), f.name
    assert not [n for n in others if n.endswith((".json", ".jsonl"))
                and any(n.startswith(b + "-") for b in tables.RENDER)], "a results file whose name report.py cannot read"


def _startup(tmp_path, name, first_byte, started=None):
    r = {"date": name.split("-h100-")[1][:10], "cpus": 16, "model": "tiny", "repeat": 1,
         "runs": {"shard-1": {"median": {"wall_s": 1.0, "first_byte_s": first_byte, "all_writing_s": first_byte,
                                         "spans_s": {}}}}}
    if started:
        r["started"] = started
    (tmp_path / name).write_text(json.dumps(r))


def test_the_newest_file_is_the_latest_date_then_start_then_commit(tmp_path):
    _startup(tmp_path, "startup-h100-2026-11-24-late.json", 9.0)
    _startup(tmp_path, "startup-h100-2026-11-25-b.json", 2.0, started="2026-11-25T08:00:00Z")
    _startup(tmp_path, "startup-h100-2026-11-25-a.json", 1.0, started="2026-11-25T09:00:00Z")
    _startup(tmp_path, "startup-h100-2026-11-25-c.json", 4.0, started="2026-11-25T09:00:00Z")
    (tmp_path / "pytest-gpu-h100-2026-11-25.txt").write_text("5 passed")
    added = {"startup-h100-2026-11-25-a.json": 2.0, "startup-h100-2026-11-25-c.json": 1.0}
    text = report.generate(str(tmp_path), added=lambda name: added.get(name, 0.0))
    # -a: the same day and start as -c, committed later; -b started earlier; -late is a day older
    assert "| shard-1 1.00 s | `startup-h100-2026-11-25-a.json` | met |" in text
    assert "`startup-h100-2026-11-25-c.json`" not in text and "`startup-h100-2026-11-24-late.json`" not in text
    assert "Not rendered (logs and one-off records): `pytest-gpu-h100-2026-11-25.txt`." in text
    assert "| #28 | shard, whole command: ≥ 1× `save_pretrained` (same run) | no file in bench/results measures it |" in text
    # equally new on all three counts: both are the newest, each in its own row
    added["startup-h100-2026-11-25-c.json"] = 2.0
    text = report.generate(str(tmp_path), added=lambda name: added.get(name, 0.0))
    assert "`startup-h100-2026-11-25-a.json` | met |" in text and "`startup-h100-2026-11-25-c.json` | **not met** |" in text


def test_write_replaces_only_what_lies_between_the_markers():
    doc = f"# title\nprose\n{report.BEGIN}\nold\n{report.END}\n## History\nrows\n"
    assert report.splice(doc, f"{report.BEGIN}\nnew\n{report.END}\n") == \
        f"# title\nprose\n{report.BEGIN}\nnew\n{report.END}\n## History\nrows\n"
    try:
        report.splice("# no markers\n", "x")
    except SystemExit as e:
        assert "markers" in str(e)
    else:
        raise AssertionError("a doc without markers was written")


def test_no_ratio_against_a_trl_that_did_not_finish():
    import tables

    run = {"workload": "grpo", "iterations": {"complete": True, "generated_tok_s_per_gpu": 8000.0}}
    assert tables._vs_trl({"trl": {"status": "ok", "generated_tok_s_per_gpu": 8000.0}}, run) == 1.0
    # A TRL killed at its deadline measured only its cold first iteration: no reference.
    assert tables._vs_trl({"trl": {"status": "timeout", "generated_tok_s_per_gpu": 4966.0}}, run) is None


def test_trl_over_all_its_iterations_is_the_like_for_like_rate():
    its = [{"seconds": 14.0, "generated_tokens": 49152}, {"seconds": 5.0, "generated_tokens": 49152},
           {"seconds": 5.0, "generated_tokens": 49152}]
    assert tables._trl_whole({"iterations": its}) == 3 * 49152 / 24.0
    assert tables._trl_whole({"iterations": [{"seconds": 5.0}]}) is None  # older files: no token counts


def test_a_ratio_just_short_of_its_goal_never_reads_as_met():
    assert report._times(0.9995, 1.0) == "0.9995×"  # 1.00× would hide that it is short
    assert report._times(1.004, 1.0) == "1.00×" and report._times(0.88, 1.5) == "0.88×"
    assert report._times(1.497, 1.5) == "1.4970×"


def test_an_iterations_idle_time_counts_stages_side_by_side_once():
    import e2e

    # Iteration 2's window runs from iteration 1's ppo done (t 10) to its own ppo done (t 30). On
    # the run's clock (t0 = 3): the ppo before it works until 12, beside the rollout (7-12); the
    # ppo works 13-29. Idle: 12-13 and 29-30.
    stages = {"iter-001/ppo": {"work_at_s": [0.0, 9.0]}, "iter-002/rollout": {"work_at_s": [4.0, 9.0]},
              "iter-002/scores": {}, "iter-002/ppo": {"work_at_s": [10.0, 26.0]}}
    assert e2e._idle(stages, 10.0, 30.0, 3.0) == {"window_s": 20.0, "idle_s": 2.0}
    inv = {"shapes": {"actor": {"hidden_size": 2048}}, "runs": [
        {"iterations": {"per_iteration": [{"iteration": 2, "window_s": 20.0, "idle_s": 4.0}]}}]}
    text, verdict = report.outside_work({"bench": "e2e", "invocations": [inv]})
    assert text.startswith("20% (iteration 2: 20.0 s, of which no stage worked 4.0 s)") and "not" in verdict


def test_scores_made_in_the_rollout_are_no_stage_of_their_own(tmp_path):
    # Rules scored in the rollout leave the score node no process: its manifest's timing is the
    # rollout's (a negative start), so it neither renders as a stage nor counts in the start goal.
    rollout = {"status": "ok", "wall_s": 10.0, "to_first_work_s": 0.5, "work_s": 9.0}
    scored = {"status": "ok", "wall_s": -0.01, "to_first_work_s": -1.4, "work_s": 0.07, "seq_s_wall": -102400.0}
    for scores in (scored, {**scored, "wall_s": 0.0, "made_elsewhere": True}):
        inv = {"id": "x", "date": "2026-12-02", "device": {"name": "GPU", "count": 1}, "trl": {},
               "runs": [{"workload": "grpo", "layout": "tp1",
                         "stages": {"iter-001/rollout": rollout, "iter-001/scores": scores}}]}
        text, verdict = report.first_work({"bench": "e2e", "invocations": [inv]})
        assert text == "1 of 1 stages; the worst 5% (iter-001/rollout)" and "not" not in verdict
        path = tmp_path / "e2e.json"
        path.write_text(json.dumps({"bench": "e2e", "invocations": [inv]}))
        lines = "\n".join(tables.e2e(str(path)))
        assert "| iter-001/scores | – | – | – | scored in the rollout | – |" in lines and "102,400" not in lines


def test_a_run_that_writes_fewer_training_states_says_so_and_measures_no_write():
    stages = {"iter-008/rollout": {"wall_s": 4.0}, "iter-008/ppo": {"wall_s": 8.0, "phases_s": {"train_state": 0.1}}}
    run = {"workload": "grpo", "layout": "tp1", "resident": True, "max_staleness": 1, "stages": stages,
           "iterations": {"complete": True, "generated_tok_s_per_gpu": 15000.0, "iterations": 8}}
    r = {"invocations": [{"shapes": {"actor": {"hidden_size": 2048}}, "train_state_every": 4, "runs": [run],
                          "trl": {"status": "ok", "generated_tok_s_per_gpu": 10000.0}}]}
    shown, _ = report.vs_trl(2048, 1, 1.5)(r)
    assert shown.endswith("8 iterations, training state written every 4 iterations)"), shown
    assert report.state_write(r) is None
    del r["invocations"][0]["train_state_every"]
    assert "training state" not in report.vs_trl(2048, 1, 1.5)(r)[0]
    assert report.state_write(r)[0].startswith("1% (iter-008: 0.1 s of 12.0 s)")
