"""The run's guards: one `llamarl run` per run directory (the run lock), and inputs from outside the
run keyed by their content."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
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
    out = " ".join(r.stderr.split())
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
    from llamarl.lib.files import publish
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


def test_the_lock_names_new_processes_at_once_and_leaves_the_rest_to_its_heartbeat(tmp_path, monkeypatch):
    """A stage's new processes are in the lock when ``started`` returns; an ended stage, or one on
    processes the lock names already (resident workers), is written by the heartbeat's thread at
    once, while the driver goes on."""
    from llamarl.pipeline.lock import RunLock

    path = tmp_path / "pipeline" / "lock.json"

    def stages():
        return json.loads(path.read_text())["stages"]

    def soon(expected):
        deadline = time.monotonic() + 5
        while stages() != expected:
            assert time.monotonic() < deadline, f"the lock says {stages()}, not {expected}"
            time.sleep(0.01)

    with RunLock(str(tmp_path), lease_s=3600) as lock:  # no beat of its own during the test
        writes = []
        write = lock._write
        monkeypatch.setattr(lock, "_write", lambda: (writes.append(threading.current_thread()), write()))
        lock.started("pool", [(101, 7), (102, 8)])
        assert list(stages()) == ["pool"] and writes == [threading.current_thread()]
        lock.started("iter-001/rollout", [(101, 7)])
        soon({"pool": {"host": socket.gethostname(), "procs": [[101, 7], [102, 8]]},
              "iter-001/rollout": {"host": socket.gethostname(), "procs": [[101, 7]]}})
        lock.ended("iter-001/rollout")
        soon({"pool": {"host": socket.gethostname(), "procs": [[101, 7], [102, 8]]}})
        assert writes[1:] and all(t is not threading.current_thread() for t in writes[1:])


# ---- takeover of a lock whose holder is gone, with its stages' processes (#27) ------------------

_SLEEPER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "time.sleep(120)")


def stage_group():
    """A process leading its own group with a child in it, as a rollout rank and its tokenizer
    process: (the process, its (pid, start) for a lock's record, the group's pids once both run)."""
    from llamarl.cluster.local import process_start, survivors

    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER], start_new_session=True)
    group = (proc.pid, process_start(proc.pid))
    deadline = time.monotonic() + 30
    while len(survivors([group]).get(proc.pid, [])) < 2:
        assert time.monotonic() < deadline, "the child process did not start"
        time.sleep(0.02)
    return proc, group, survivors([group])[proc.pid]


def _gone_holder(stages: dict, **changes) -> dict:
    """A lock of a driver on this host whose process is gone, with ``stages`` recorded."""
    from llamarl.pipeline.lock import RunLock

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    me = RunLock("unused").me
    return {**me, "pid": proc.pid, "pid_start": None, "heartbeat": time.time(), "stages": stages, **changes}


def test_a_takeover_first_stops_what_the_gone_drivers_stages_left_running(tmp_path):
    from llamarl.cluster.local import survivors

    proc, group, pids = stage_group()
    try:
        holder = _gone_holder({"iter-001/rollout": {"host": socket.gethostname(), "procs": [list(group)]}})
        (tmp_path / "pipeline").mkdir()
        (tmp_path / "pipeline" / "lock.json").write_text(json.dumps(holder))
        said = []
        with RunLock(str(tmp_path), echo=said.append):
            assert survivors([group]) == {}  # gone before the lock is ours: never two writers
        assert said[0] == (f"stopped iter-001/rollout of the previous run by {holder['user']}@{holder['host']} "
                           f"(pid {holder['pid']}), which is gone: its process(es) {', '.join(map(str, pids))} still ran")
        assert said[1].endswith("its process is gone") and len(said) == 2
    finally:
        proc.kill()
        proc.wait()


def test_a_takeover_refuses_what_this_user_cannot_stop(tmp_path):
    """The old driver's stage runs as another user (here: root) than the new `llamarl run`
    (nobody): it cannot stop it, so it refuses in one line naming the processes and the command."""
    import tempfile

    from llamarl.cluster.local import survivors

    if os.geteuid() != 0:
        pytest.skip("needs root, to run the taking-over process as another user (nobody)")
    proc, group, pids = stage_group()
    run = tempfile.mkdtemp(prefix="llamarl-lock-")  # under /tmp: nobody reaches it (pytest's tmp_path is private)
    try:
        os.chmod(run, 0o777)
        os.mkdir(os.path.join(run, "pipeline"), 0o777)
        os.chmod(os.path.join(run, "pipeline"), 0o777)
        holder = _gone_holder({"iter-001/ppo": {"host": socket.gethostname(), "procs": [list(group)]}})
        with open(os.path.join(run, "pipeline", "lock.json"), "w") as f:
            json.dump(holder, f)
        script = ("import sys\nfrom llamarl.pipeline.lock import RunLock, RunLocked\ntry:\n"
                  "    RunLock(sys.argv[1]).acquire()\nexcept RunLocked as e:\n    print(e)\n    sys.exit(2)\n")
        r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                            script, run], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stdout.strip().splitlines() == [
            f"{run}/pipeline/lock.json: iter-001/ppo of the previous run by {holder['user']}@{holder['host']} (pid "
            f"{holder['pid']}), which is gone, still runs as iter-001/ppo: process(es) {group[0]} of another user; "
            f"stop them first (kill -KILL -- -{group[0]}, as that user), then rerun"]
        assert survivors([group])[proc.pid] == pids  # still running
        assert json.load(open(os.path.join(run, "pipeline", "lock.json")))["pid"] == holder["pid"]  # untouched
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(run, ignore_errors=True)


def test_a_holder_on_another_host_is_taken_over_only_when_stale_saying_what_is_assumed(tmp_path):
    stages = {"iter-002/rollout": {"host": "node7", "procs": [[4242, 1], [4243, 1]]}}
    holder = {"user": "ada", "host": "node7", "pid": 17, "started": time.time() - 600, "lease_s": 120, "stages": stages}
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps({**holder, "heartbeat": time.time() - 10}))
    with pytest.raises(RunLocked, match=r"being run by ada@node7 \(pid 17\)"):
        RunLock(str(tmp_path)).acquire()
    (tmp_path / "pipeline" / "lock.json").write_text(json.dumps({**holder, "heartbeat": time.time() - 300}))
    said = []
    with RunLock(str(tmp_path), echo=said.append):
        pass
    assert said == ["taking over the run lock of ada@node7 (pid 17): no heartbeat for 300s (lease 120s); assuming its "
                    "stages ended with it (iter-002/rollout: process(es) 4242, 4243 on node7): if they still run there, "
                    "stop them first (kill -KILL -- -4242 -4243)"]


def test_a_driver_alive_on_this_host_without_a_heartbeat_keeps_the_run(tmp_path):
    """Suspended (Ctrl-Z): it would write again once resumed, so its lock is not taken over."""
    from llamarl.cluster.local import process_start

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holder = {**RunLock("unused").me, "pid": proc.pid, "pid_start": process_start(proc.pid),
                  "heartbeat": time.time() - 1000}
        (tmp_path / "pipeline").mkdir()
        (tmp_path / "pipeline" / "lock.json").write_text(json.dumps(holder))
        with pytest.raises(RunLocked, match=rf"heartbeat 1000s ago \(on this host, without a heartbeat: suspended\? "
                                            rf"resume it with `kill -CONT {proc.pid}`\)"):
            RunLock(str(tmp_path)).acquire()
        assert RunLock(str(tmp_path)).holder() is not None  # and status says it holds the run
    finally:
        proc.kill()
        proc.wait()


def test_a_stage_process_that_outlives_the_stop_keeps_the_lock_for_the_next_takeover(tmp_path):
    proc, group, pids = stage_group()
    try:
        said = []
        lock = RunLock(str(tmp_path), echo=said.append)
        lock.acquire()
        lock.started("iter-001/rollout", [group])
        assert json.loads((tmp_path / "pipeline" / "lock.json").read_text())["stages"]["iter-001/rollout"]["procs"] == [
            list(group)]
        lock.release()  # as if its processes had survived SIGKILL: they were never ended
        assert (tmp_path / "pipeline" / "lock.json").exists()
        assert said == [f"{tmp_path}/pipeline/lock.json stays: iter-001/rollout: process(es) "
                        f"{', '.join(map(str, pids))} still run; the next `llamarl run` stops them"]
        lock = RunLock(str(tmp_path / "other"))
        lock.acquire()
        lock.started("x", [group])
        lock.ended("x")  # written by the heartbeat's thread, at once
        deadline = time.monotonic() + 5
        while json.loads((tmp_path / "other" / "pipeline" / "lock.json").read_text())["stages"] != {}:
            assert time.monotonic() < deadline, "the ended stage is still in the lock"
            time.sleep(0.01)
        lock.release()
        assert not (tmp_path / "other" / "pipeline" / "lock.json").exists()
    finally:
        proc.kill()
        proc.wait()


# ---- one-line errors for a spec or storage that cannot be used ---------------------------------------


def _llamarl(*args, user: str | None = None) -> subprocess.CompletedProcess:
    prefix = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups"] if user else []
    return subprocess.run([*prefix, sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})


def _refused(r: subprocess.CompletedProcess) -> str:
    """The one line of a refused command (exit status 2, no traceback)."""
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(out.splitlines()) == 1 and out.startswith("error: "), out
    return out


@pytest.fixture
def shared_dir():
    """A folder under /tmp that another user (nobody) can reach: pytest's tmp_path is private."""
    import tempfile

    path = tempfile.mkdtemp(prefix="llamarl-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", ["folder", "binary", "unreadable", "list"])
def test_a_spec_that_cannot_be_read_is_one_line(tmp_path, shared_dir, kind):
    if kind == "unreadable" and os.geteuid() != 0:
        pytest.skip("needs root, to read the spec as another user (nobody)")
    where = shared_dir if kind == "unreadable" else str(tmp_path)  # (root reads any file)
    spec = os.path.join(where, "spec.yaml")
    if kind == "folder":
        os.mkdir(spec)
    elif kind == "binary":
        open(spec, "wb").write(bytes(range(128, 256)))
    else:
        open(spec, "w").write("- a\n- b\n" if kind == "list" else "name: x\n")
        os.chmod(spec, 0o644 if kind == "list" else 0o000)
    why = {"folder": "cannot be read as a run spec (it is a folder); give the spec's YAML file",
           "binary": "cannot be read as a run spec (not a text file); give the spec's YAML file",
           "unreadable": "cannot be read as a run spec (Permission denied); give the spec's YAML file",
           "list": "expected a mapping of options, got list"}[kind]
    for dry in ([], ["--dry-run"]):
        r = _llamarl("run", spec, *dry, user="nobody" if kind == "unreadable" else None)
        assert _refused(r) == f"error: {spec}: {why}"


@pytest.mark.parametrize("kind", ["file", "read-only", "not-ours"])
def test_storage_that_cannot_hold_the_run_is_one_line_also_in_a_dry_run(shared_dir, kind):
    if kind != "file" and os.geteuid() != 0:
        pytest.skip("needs root: to mount a read-only file system, and to run as another user (nobody)")
    where = shared_dir
    storage = os.path.join(where, "storage")
    if kind == "file":
        open(storage, "w").write("not a folder")
    elif kind == "read-only":
        os.mkdir(storage)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", storage]).returncode:
            pytest.skip("cannot mount a tmpfs here")
    else:
        os.mkdir(storage, 0o755)  # root's: nobody may not write in it
    spec = os.path.join(where, "spec.yaml")
    with open(spec, "w") as f:
        yaml.safe_dump({"name": "r", "storage": storage, "actor": "/nowhere/actor", "prompts": "/nowhere/p.jsonl",
                        "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]}}, f)
    os.chmod(spec, 0o644)
    why = {"file": f"{storage} is a file, not a folder; point storage at a folder (the run lives in STORAGE/NAME)",
           "read-only": f"cannot write to {storage} (read-only file system); point storage at a folder you can write to",
           "not-ours": f"cannot write to {storage} (permission denied); point storage at a folder you can write to"}[kind]
    try:
        for dry in ([], ["--dry-run"]):
            r = _llamarl("run", spec, *dry, user="nobody" if kind == "not-ours" else None)
            assert _refused(r) == f"error: {spec}: storage: {why}"
    finally:
        if kind == "read-only":
            subprocess.run(["umount", "-l", storage])


def test_an_options_file_that_cannot_be_read_is_one_line(tmp_path):
    r = _llamarl("stage", "rollout", "ACTOR", "PROMPTS", "OUT", "--config", str(tmp_path))
    assert _refused(r) == f"error: {tmp_path}: cannot be read as an options file (it is a folder); check the --config path"


def test_a_run_folder_that_holds_someone_elses_files_is_refused_and_left_as_it_was(tmp_path):
    storage = tmp_path / "storage"
    (storage / "r" / "export").mkdir(parents=True)
    (storage / "r" / "metrics.jsonl").write_text("mine\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "r", "storage": str(storage), "actor": "/nowhere/actor",
                                    "prompts": "/nowhere/p.jsonl",
                                    "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]}}))
    for dry in ([], ["--dry-run"]):
        r = _llamarl("run", str(spec), *dry)
        assert _refused(r) == (f"error: {spec}: {storage}/r (STORAGE/NAME) holds files and is no llamarl run (no "
                               "pipeline/ in it), which the run would write over; change storage or name, or empty "
                               "that folder")
    assert sorted(os.listdir(storage / "r")) == ["export", "metrics.jsonl"]
    assert (storage / "r" / "metrics.jsonl").read_text() == "mine\n"


@pytest.mark.parametrize("url", ["foo://bar", "s3://no-bucket/run"])
def test_a_url_of_a_file_system_fsspec_cannot_open_is_one_line(tmp_path, url):
    import importlib.util

    if url.startswith("s3") and importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    why = "Protocol not known: foo" if url.startswith("foo") else "Install s3fs to access S3"
    tail = f"cannot be opened ({why}); give a local path or a URL of an installed fsspec file system"
    assert _refused(_llamarl("status", url)) == f"error: {url}: {tail}"
    assert _refused(_llamarl("run", f"{url}/spec.yaml")) == f"error: {url}/spec.yaml: {tail}"
    assert _refused(_llamarl("run", "")) == "error: the run spec's path is empty; give the spec's YAML file"


def test_a_stage_whose_output_folder_cannot_be_made_is_one_line_before_any_rank_starts(tmp_path):
    (tmp_path / "a-file").write_text("x")
    r = _llamarl("stage", "export", str(tmp_path / "nowhere"), str(tmp_path / "a-file" / "out"))
    assert _refused(r) == (f"error: llamarl stage export: DST: {tmp_path}/a-file is a file, not a folder; point DST "
                           "at a folder")
    r = _llamarl("stage", "ppo", "ROLLOUT", "SCORES", "ACTOR", str(tmp_path / "a-file" / "out"))
    assert _refused(r) == (f"error: llamarl stage ppo: OUT: {tmp_path}/a-file is a file, not a folder; point OUT "
                           "at a folder")


@pytest.mark.parametrize("stage,flag", [("shard", "--tp"), ("export", "--procs"), ("ppo", "--dp")])
def test_a_process_count_below_one_is_one_line_naming_the_flag(stage, flag):
    args = {"shard": ["SRC", "DST"], "export": ["SRC", "DST"], "ppo": ["ROLLOUT", "SCORES", "ACTOR", "OUT"]}[stage]
    r = _llamarl("stage", stage, *args, flag, "0")
    assert _refused(r) == f"error: {flag}=0: Input should be greater than or equal to 1"


def test_a_stage_output_inside_a_published_output_is_refused_in_one_line(tmp_path):
    from llamarl.lib.files import publish

    published = tmp_path / "rollout"
    published.mkdir()
    publish.publish(str(published), {"kind": "rollout", "files": {}})
    before = sorted(os.listdir(published))
    r = _llamarl("stage", "ppo", "ROLLOUT", "SCORES", "ACTOR", str(published / "sub" / "ppo"))
    assert _refused(r) == (f"error: llamarl stage ppo: OUT: {published}/sub/ppo lies inside the published output "
                           f"{published}; point OUT at a folder outside it")
    assert sorted(os.listdir(published)) == before
