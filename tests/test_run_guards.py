"""The run's guards: one `llamarl run` per run directory (the run lock), and inputs from outside the
run keyed by their content."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from llamarl.pipeline.lock import RunLock, RunLocked


def test_a_second_run_is_refused_until_the_first_releases(tmp_path):
    first = RunLock(str(tmp_path))
    first.acquire()
    with pytest.raises(RunLocked, match=rf"being run by .*@{socket.gethostname()} \(pid {os.getpid()}\)"):
        RunLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / "pipeline" / "lock.json").exists()
    with RunLock(str(tmp_path)):
        assert (tmp_path / "pipeline" / "lock.json").exists()


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path):
    (tmp_path / "pipeline").mkdir()
    dead = {"user": "ada", "host": "node7", "pid": 4242, "started": time.time() - 5000, "lease_s": 120,
            "heartbeat": time.time() - 1000}
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps(dead))
    said = []
    with RunLock(str(tmp_path), echo=said.append):
        held = json.loads((tmp_path / "pipeline" / "lock.json").read_text())
        assert held["pid"] == os.getpid()
    assert said and "ada@node7 (pid 4242)" in said[0] and "no heartbeat for 1000s" in said[0]


def test_the_heartbeat_keeps_a_long_run_locked(tmp_path):
    with RunLock(str(tmp_path), lease_s=0.4):
        first = json.loads((tmp_path / "pipeline" / "lock.json").read_text())["heartbeat"]
        time.sleep(0.9)  # longer than the lease: without heartbeats the lock would be stale
        with pytest.raises(RunLocked):
            RunLock(str(tmp_path), lease_s=0.4).acquire()
        assert json.loads((tmp_path / "pipeline" / "lock.json").read_text())["heartbeat"] > first


def test_llamarl_run_exits_at_once_when_the_run_is_held(tmp_path):
    spec = {"name": "held", "storage": str(tmp_path), "actor": "/nowhere/actor", "prompts": "/nowhere/p.jsonl",
            "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with RunLock(str(tmp_path / "held")):
        r = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(tmp_path / "spec.yaml")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "this run is being run by" in out and f"pid {os.getpid()}" in out
    assert not (tmp_path / "held" / "pipeline" / "spec.yaml").exists()


def test_a_killed_run_on_this_host_is_taken_over_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    (tmp_path / "pipeline").mkdir()
    gone = {"user": "me", "host": socket.gethostname(), "pid": proc.pid, "started": time.time(), "lease_s": 120,
            "heartbeat": time.time()}
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps(gone))
    said = []
    with RunLock(str(tmp_path), echo=said.append):
        pass
    assert said and "its process is gone" in said[0]


def test_a_restarted_driver_with_the_dead_ones_pid_takes_the_lock_at_once(tmp_path):
    """A driver container restarted in its pod: same hostname, same pid (1), but the process that
    held the lock is gone — its start time differs."""
    me = RunLock(str(tmp_path)).me
    (tmp_path / "pipeline").mkdir()
    old = {**me, "pid_start": me["pid_start"] - 100, "started": time.time() - 60, "heartbeat": time.time()}
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps(old))
    said = []
    with RunLock(str(tmp_path), echo=said.append):
        pass
    assert said and "its process is gone" in said[0]
    # The same process (same start time) still holds it: refused.
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps({**me, "heartbeat": time.time()}))
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path)).acquire()


def test_inputs_from_outside_the_run_are_keyed_by_content(tmp_path):
    from llamarl.lib import publish
    from llamarl.pipeline.dag import build_dag, load_spec
    from llamarl.pipeline.records import assess, fingerprint, node_key, write_record

    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "model.safetensors").write_bytes(b"x" * 100)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    spec = {"name": "keyed", "storage": str(tmp_path), "actor": str(tmp_path / "actor"), "prompts": str(prompts),
            "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    nodes = {n.name: n for n in build_dag(load_spec(str(tmp_path / "spec.yaml")))}
    shard = nodes["shard/actor"]
    key, fp = node_key(shard, nodes), fingerprint(str(tmp_path / "actor"))
    # Pretend shard ran: a published output and its record.
    publish.prepare(shard.out, lambda m: False)
    publish.publish(shard.out, {"kind": "checkpoint", "files": {}})
    run = str(tmp_path / "keyed")
    write_record(run, shard, status="done", key=key, output_id=publish.output_id(shard.out),
                 external={str(tmp_path / "actor"): fp})
    assert assess(run, shard, nodes, set())[0]
    time.sleep(0.01)
    (tmp_path / "actor" / "model.safetensors").write_bytes(b"y" * 100)  # replaced in place, same size
    assert node_key(shard, nodes) != key
    done, why = assess(run, shard, nodes, set())
    assert not done and why == f"{tmp_path / 'actor'} changed since it ran"
    before = fingerprint(str(prompts))
    prompts.write_text('{"prompt": "a"}\n')  # cut
    assert fingerprint(str(prompts)) != before


def test_placement_options_never_make_a_stage_stale(tmp_path):
    # score.offload says where the RM's weights wait between parts, not what is computed: the
    # stage's identity (its output's request, and the pipeline's key) is the same either way.
    from llamarl.pipeline.dag import build_dag, load_spec

    identities = []
    for offload, tp in ((True, 1), (False, 2)):
        spec = {"name": "p", "storage": str(tmp_path), "actor": str(tmp_path / "a"), "prompts": str(tmp_path / "p"),
                "layout": {"score": {"tp": tp}},
                "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}], "offload": offload}}
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
        score = next(n for n in build_dag(load_spec(str(tmp_path / "spec.yaml"))) if n.stage == "score")
        identities.append(score.make_config().identity())
    assert identities[0] == identities[1]
    assert identities[0]["rewards"]  # what it computes is still there


def test_prompts_are_keyed_by_their_bytes(tmp_path):
    from llamarl.pipeline.records import fingerprint

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    stat = prompts.stat()
    before = fingerprint(str(prompts), checksums=True)
    prompts.write_text('{"prompt": "b"}\n')  # same size
    os.utime(prompts, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same time
    assert fingerprint(str(prompts), checksums=True) != before


def test_status_says_who_runs_the_run(tmp_path):
    from llamarl.pipeline.lock import RunLock

    with RunLock(str(tmp_path)) as lock:
        assert f"(pid {os.getpid()})" in lock.holder() and "heartbeat" in lock.holder()
    assert RunLock(str(tmp_path)).holder() is None
