"""Start-up stays cheap, and the I/O benchmarks run (on CPU, small)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each costs a stage process 0.3-6 s of imports before its first byte, and no stage module needs one
# to be imported (DCP's classes are imported when a checkpoint's .metadata is read or written).
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo", "megatron", "transformers",
         "sympy", "pyarrow")  # pyarrow: 1.3 s on the GPU machines, and shard/export read no parts


def test_stage_and_cli_imports_stay_light():
    code = "import json, sys, llamarl.pipeline.cli, llamarl.stages.shard, llamarl.stages.export; print(json.dumps(list(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       cwd="/").stdout)
    assert not [m for m in loaded if m.startswith(HEAVY)], [m for m in loaded if m.startswith(HEAVY)][:10]
    cli = subprocess.run([sys.executable, "-c", "import sys, llamarl.pipeline.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    assert cli == "False"  # the command line loads torch only in the stage processes


def test_the_driver_hashes_a_local_file_without_torch(tmp_path):
    # `llamarl run` checksums the prompts: hashing in place must not pull torch into the driver.
    (tmp_path / "f").write_bytes(b"x" * 5000)
    code = ("import sys; from llamarl.lib.files import checksums; "
            f"checksums.checksum({str(tmp_path / 'f')!r}); checksums.checksum({str(tmp_path / 'f')!r}, checksums.TREE); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False"


def test_a_stage_process_imports_with_the_collector_off_and_runs_with_it_on(tmp_path):
    # shard and export import with the garbage collector off (each collection would walk all
    # that torch made); job.main freezes what the imports made and turns it on for the work.
    code = f"""
import gc, runpy, sys
from llamarl.lib.runtime import job
stage_main = job.main
def main(cls, _run, argv=None):  # the stage's run replaced by a probe
    print(gc.isenabled(), flush=True)  # as the stage's imports left it
    stage_main(cls, lambda cfg: print(gc.isenabled(), gc.get_freeze_count() > 0, flush=True), argv)
job.main = main
sys.argv = ["shard", "--config-json", '{{"src": "{tmp_path}/hf", "dst": "{tmp_path}/out"}}']
runpy.run_module("llamarl.stages.shard", run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


@pytest.mark.slow
def test_startup_bench_profiles_every_step(tmp_path):
    out = tmp_path / "startup.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "startup.py"), "--procs", "1", "--repeat", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=300, cwd="/")
    res = json.loads(out.read_text())
    for name in ("shard-1", "export-1"):
        run = res["runs"][name]["runs"][0]
        assert set(run["spans_s"]) == {"cli", "imports", "config", "process_group", "planning", "work", "exit"}
        assert all(v is not None and v >= -0.02 for v in run["spans_s"].values()), run["spans_s"]
        assert run["first_byte_s"] < run["wall_s"] and abs(run["first_byte_polled_s"] - run["first_byte_s"]) < 0.5


@pytest.mark.slow
def test_handoff_bench_small_on_cpu(tmp_path):
    out = tmp_path / "handoff.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "handoff.py"), "--small", "--repeat", "1", "--cold",
                    "--device", "cpu", "--out", str(out)], check=True, capture_output=True, timeout=300, cwd="/")
    res = json.loads(out.read_text())
    assert res["bit_identical"] and res["device"] == "cpu" and res["shape"] == "small"
    m = res["median"]
    assert m["GB"] > 0.005 and m["handoff_s"] == pytest.approx(m["save_s"] + m["verify_s"] + m["build_s"] + m["load_s"])
