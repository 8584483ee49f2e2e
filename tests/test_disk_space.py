"""A full disk, for real (#27, #26): small tmpfs mounts (root only; skipped elsewhere, saying why).

A stage whose write fails with ENOSPC — bytes or inodes exhausted, another writer having filled
the disk after the stage's free-space check — ends with one line naming the path and "no space
left on device", exit status 2, in its output and in the run's record (`llamarl status`); rerun
after freeing space, it completes with the same bytes. A stage whose output cannot fit is refused
before it writes (stages/space.py), and the estimates bound what the stages really write."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import yaml

from llamarl.cluster.local import LocalExecutor
from llamarl.lib.errors import EXIT_USER_ERROR
from llamarl.pipeline import demo
from llamarl.pipeline.dag import build_dag, load_spec
from llamarl.stages import space

pytestmark = pytest.mark.slow

ENV = {**os.environ, "COLUMNS": "400"}
FIX = "free space there, or set `retention: {keep_last: N}` in the run spec so older iterations are deleted"


def _mount(path, **options) -> None:
    os.makedirs(path, exist_ok=True)
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): these tests need root")


def _remount(path, **options) -> None:
    opts = ",".join(["remount", *(f"{k}={v}" for k, v in options.items())])
    subprocess.run(["mount", "-o", opts, str(path)], check=True)


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, size=…, nr_inodes=…)``: a tmpfs mounted at ``tmp_path/name``, gone after the test."""
    mounted = []

    def mount(name: str, **options):
        path = tmp_path / name
        _mount(path, **options)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        _umount(path)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True, text=True,
                          timeout=900, env=ENV)


def _spec(root, name: str, storage) -> str:
    """One iteration on the demo's models, every stage on one process, the rule as the reward."""
    data = yaml.safe_load(open(demo.make_inputs(str(root))))
    data.update(name=name, storage=str(storage), iterations=1, reward_model=None, layout=demo.OVERLAP_LAYOUT,
                executor={"kind": "local", "options": {"threads_per_process": 1}},
                score={"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0}]})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A whole run on a tmpfs of its own (its export test fills it by inodes): (spec, run, nodes by name)."""
    root = tmp_path_factory.mktemp("disk")
    storage = root / "storage"
    _mount(storage, size="64m")
    try:
        spec = _spec(root, "full", storage)
        r = _cli("run", spec)
        assert r.returncode == 0, r.stdout + r.stderr
        loaded = load_spec(spec)
        yield spec, loaded.run_dir, {n.name: n for n in build_dag(loaded)}
    finally:
        _umount(storage)


def _files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` but the manifests (their creation time), DCP's .metadata (its
    path) and the metrics (their timings)."""
    out = {}
    for d, _, names in os.walk(folder):
        for name in names:
            if name not in ("llamarl.json", ".metadata", "metrics.jsonl"):
                path = os.path.join(d, name)
                out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def _fill_once_started(out: str, disk, begun: str = ".llamarl-incomplete") -> threading.Thread:
    """Another writer: once the stage has begun its output (``begun`` exists in it: its marker, the
    free-space check passed), fill ``disk`` to the last byte."""

    def fill():
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(out, begun)) and time.monotonic() < deadline:
            time.sleep(0.002)
        with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:
            for size in (1 << 20, 64 << 10, 4 << 10, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    continue

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    return thread


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_estimates_bound_what_each_stage_wrote(finished, tmp_path):
    _, run, nodes = finished
    for node in nodes.values():
        cfg = node.make_config()
        elsewhere = str(tmp_path / node.name.replace("/", "."))
        cfg = cfg.model_copy(update={("dst" if node.stage in ("shard", "export") else "out"): elsewhere})
        need = space._ESTIMATES[type(cfg)](cfg, elsewhere).bytes
        wrote = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(node.out) for f in names)
        assert wrote <= need, (node.name, wrote, need)


@pytest.mark.parametrize("stage,size", [("rollout", "4m"), ("ppo", "16m")])
def test_a_write_to_a_full_disk_is_one_line_and_a_rerun_resumes_with_the_same_bytes(finished, tmpfs, capfd, stage, size):
    _, run, nodes = finished
    node = nodes[f"iter-001/{stage}"]
    disk = tmpfs(stage, size=size)
    out = str(disk / stage)
    # The rollout alone (not the run's scores it would also publish, which score this rollout's out).
    cfg = node.make_config().model_copy(update={"out": out} | ({"scores": None} if stage == "rollout" else {}))
    # ppo checks the room again before its first write (space.Room.wait): the disk fills as it writes.
    filler = _fill_once_started(out, disk, "actor" if stage == "ppo" else ".llamarl-incomplete")
    result = LocalExecutor().run(stage, cfg, 1)
    filler.join(60)
    assert result.code == EXIT_USER_ERROR
    assert result.error == f"{out}: no space left on device; {FIX}, then rerun: what was published is kept"
    assert _one_error_line(capfd.readouterr().err) == f"error: {result.error}"
    os.remove(disk / "filler")  # space freed
    assert LocalExecutor().run(stage, cfg, 1).ok
    assert _files(out) == _files(node.out) and _files(out)


def test_a_full_disk_in_a_run_is_the_records_error_and_a_rerun_completes(finished):
    """The export of a run, its file system out of inodes: one line, exit status 2, and the
    record's error in `llamarl status`; with room again, the rerun exports the same bytes."""
    spec, run, nodes = finished
    export = nodes["export"].out
    before = _files(export)
    shutil.rmtree(export)
    os.remove(os.path.join(run, "pipeline", "export.json"))
    storage = os.path.dirname(run)
    fs = os.statvfs(storage)
    # Room for the lock, the export's record, its folder, marker and weights: then no more files.
    _remount(storage, nr_inodes=fs.f_files - fs.f_ffree + 5)
    r = _cli("run", spec)
    assert r.returncode == EXIT_USER_ERROR and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    error = f"{export}: no space left on device; {FIX}, then rerun: what was published is kept"
    assert r.stderr.strip().splitlines()[-1] == (f"error: stage export failed ({error}); fix it and rerun `llamarl "
                                                 f"run` — finished stages are kept")
    assert json.load(open(os.path.join(run, "pipeline", "export.json")))["error"] == error
    status = _cli("status", run)
    assert re.search(r"│ export +│ failed +│ failed: \S+/export: no space left on device; ", status.stdout), status.stdout
    _remount(storage, nr_inodes=1 << 20)
    rerun = _cli("run", spec)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _files(export) == before


def test_a_stage_that_cannot_fit_is_refused_before_it_writes(finished, tmpfs, capfd):
    _, run, nodes = finished
    disk = tmpfs("small", size="1m")
    out = str(disk / "ppo")
    result = LocalExecutor().run("ppo", nodes["iter-001/ppo"].make_config().model_copy(update={"out": out}), 1)
    assert result.code == EXIT_USER_ERROR
    m = re.fullmatch(rf"{re.escape(out)}: ppo needs ([\d.]+) MB there \(weights [\d.]+ kB, training state [\d.]+ MB\), but its "
                     rf"file system has ([\d.]+) (MB|kB) free; free space, or set `retention: \{{keep_last: N\}}` in "
                     rf"the run spec so older iterations are deleted", result.error)
    assert m, result.error
    assert _one_error_line(capfd.readouterr().err) == f"error: {result.error}"
    assert not os.path.exists(out)  # nothing written


def test_a_stage_waits_for_the_room_the_run_is_deleting(finished, tmpfs, monkeypatch, capsys):
    # `llamarl run` moves what retention deletes into its trash and empties it beside the next
    # stage (pipeline/retention.py Trash). A stage that needs that room waits for it rather than
    # count it as free: it would write as fast as the trash is deleted.
    from llamarl.lib.files import publish
    from llamarl.lib.errors import UserError

    _, run, nodes = finished
    disk = tmpfs("deleting", size="64m")
    cfg = nodes["iter-001/ppo"].make_config().model_copy(update={"out": str(disk / "ppo")})
    need = float(re.search(r"needs ([\d.]+) MB", _refusal(space.check, cfg, tmpfs)).group(1)) * 1e6
    trash = disk / "trash"
    trash.mkdir()
    (trash / "training-state").write_bytes(b"\0" * int(shutil.disk_usage(disk).free - need / 2))
    monkeypatch.delenv(publish.TRASH_ENV, raising=False)
    with pytest.raises(UserError, match="ppo needs"):
        space.check(cfg)
    monkeypatch.setenv(publish.TRASH_ENV, str(run))  # a trash on another file system frees nothing here
    t0 = time.monotonic()
    with pytest.raises(UserError, match="ppo needs"):
        space.check(cfg)
    assert time.monotonic() - t0 < 1  # nothing to wait for
    monkeypatch.setenv(publish.TRASH_ENV, str(trash))
    small = disk / "small-trash"
    small.mkdir()
    (small / "actor").write_bytes(b"\0" * 4096)
    monkeypatch.setenv(publish.TRASH_ENV, str(small))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="ppo needs"):  # even emptied, it would leave too little
        space.check(cfg)
    assert time.monotonic() - t0 < 1
    monkeypatch.setenv(publish.TRASH_ENV, str(trash))
    monkeypatch.setattr(space, "STALLED_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(UserError, match="ppo needs"):  # a trash that frees nothing: refused
        space.check(cfg)
    assert time.monotonic() - t0 >= 0.5
    monkeypatch.setattr(space, "STALLED_S", 30.0)
    deleter = threading.Timer(1.0, lambda: shutil.rmtree(trash))
    deleter.start()
    t0 = time.monotonic()
    space.check(cfg)  # room, once the trash is deleted
    assert time.monotonic() - t0 >= 0.9 and not trash.exists()
    deleter.join()
    assert f"{cfg.out}: waiting for the run's retention to delete " in capsys.readouterr().out


def test_ppo_waits_for_the_trash_before_its_first_write_not_before_its_work(finished, tmpfs, monkeypatch):
    # ppo writes only after its update: the room the run's trash frees is waited for then
    # (space.check(defer=True), Room.wait), while the trash is deleted beside its reference pass
    # and update, not before its work begins.
    from llamarl.lib.files import publish

    _, run, nodes = finished
    disk = tmpfs("deferred", size="64m")
    out = str(disk / "ppo")
    cfg = nodes["iter-001/ppo"].make_config().model_copy(update={"out": out})
    need = float(re.search(r"needs ([\d.]+) MB", _refusal(space.check, cfg, tmpfs)).group(1)) * 1e6
    trash = disk / "trash"
    trash.mkdir()
    (trash / "training-state").write_bytes(b"\0" * int(shutil.disk_usage(disk).free - need / 2))
    monkeypatch.setenv(publish.TRASH_ENV, str(trash))

    t0 = time.monotonic()
    room = space.check(cfg, defer=True)
    assert time.monotonic() - t0 < 0.5 and trash.exists()  # no wait yet
    threading.Timer(1.0, lambda: shutil.rmtree(trash)).start()
    t0 = time.monotonic()
    room.wait()
    assert time.monotonic() - t0 >= 0.9 and not trash.exists()
    t0 = time.monotonic()
    room.wait()  # once
    assert time.monotonic() - t0 < 0.1

    # The stage, the trash leaving it less room than it writes: it begins its work (its output's
    # marker) with the trash still there, and says it waits only then; the trash is deleted once it
    # says so, and it completes. A ppo that wrote without waiting would fail for want of room, one
    # that waited before its work would never begin it.
    from llamarl.cluster.executor import free_port, stage_command

    trash.mkdir()
    (trash / "training-state").write_bytes(b"\0" * int(shutil.disk_usage(disk).free - (256 << 10)))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(stage_command("ppo", cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waiting for the run's retention to delete" in line:
            assert os.path.exists(os.path.join(out, publish.INCOMPLETE)), lines  # its work has begun
            shutil.rmtree(trash)
    assert proc.wait(timeout=300) == 0, "".join(lines)
    assert not trash.exists() and publish.read_manifest(out) is not None


def _refusal(check, cfg, tmpfs) -> str:
    """The refusal of ``cfg`` with its output moved to a 1 MB disk: it says what the stage needs."""
    from llamarl.lib.errors import UserError

    with pytest.raises(UserError) as e:
        check(cfg.model_copy(update={"out": str(tmpfs("tiny", size="1m") / "ppo")}))
    return str(e.value)


def test_a_run_whose_storage_cannot_hold_a_stage_says_so_in_one_line_and_in_status(tmp_path, tmpfs):
    storage = tmpfs("cramped", size="1m")
    spec = _spec(tmp_path, "cramped", storage)
    r = _cli("run", spec)
    assert r.returncode == EXIT_USER_ERROR, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: stage shard/actor failed \({re.escape(str(storage))}/cramped/shard/actor: shard needs "
                        rf"[\d.]+ MB there \(weights [\d.]+ kB\), but its file system has [\d.]+ [kM]B free; free space, "
                        rf"or set .*\); fix it and rerun `llamarl run` — finished stages are kept", last), last
    assert not os.path.exists(storage / "cramped" / "shard" / "actor")
    status = _cli("status", str(storage / "cramped"))
    assert re.search(r"│ shard/actor +│ failed +│ failed: \S+/shard/actor: shard needs ", status.stdout), status.stdout


def _torch_save_to_file(path):
    import torch

    with open(path, "wb") as f:
        torch.save(torch.zeros(1 << 16), f)


def _pyarrow_via_fsspec(path):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(path, "wb") as f:
        pq.write_table(pa.table({"x": list(range(1 << 16))}), f, compression=None)


def _pyarrow_to_path(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": list(range(1 << 16))}), path, compression=None)


def _checkpoint(path):
    """lib/dcp_format's writer (shard, ppo): each rank's failure gathered into one RuntimeError."""
    import torch

    from llamarl.lib.files import dcp_format

    data = torch.zeros((1 << 8, 1 << 8), dtype=torch.float32)
    piece = dcp_format.Piece("w", tuple(data.shape), (0, 0), tuple(data.shape), torch.float32, lambda: data)
    dcp_format.save([piece], path)


@pytest.mark.parametrize("write", [_torch_save_to_file, _pyarrow_via_fsspec, _pyarrow_to_path, _checkpoint])
def test_the_errors_writers_raise_on_a_full_disk_are_recognised(tmpfs, write):
    """What torch, pyarrow and our checkpoint writer raise when the disk fills, for real: an
    OSError, or one it was raised from or quotes."""
    from llamarl.lib.runtime import job
    from llamarl.lib.errors import disk_full

    disk = tmpfs("tiny", size="64k")
    with pytest.raises(Exception) as raised:
        write(str(disk / "out"))
    assert disk_full(raised.value) == "no space left on device", repr(raised.value)
    job.writes_to(str(disk))
    assert job._disk_full(raised.value).startswith(f"{disk}: no space left on device; ")


def test_a_replaced_file_is_whole_before_or_after_even_on_a_full_disk(tmpfs):
    """What the driver keeps (records, the run's metrics, the lock) is replaced whole
    (``publish.replace``): a write that cannot fit leaves the old file and names the file; on a
    disk with no room for a file beside it, one that fits the old file's own blocks goes there."""
    from llamarl.lib.files import publish

    disk = tmpfs("replace", size="64k", nr_inodes=6)
    record = disk / "iter-001.ppo.json"
    publish.replace(str(record), b'{"status": "running"}')
    with open(disk / "filler", "wb") as f:  # the rest of the bytes taken
        with pytest.raises(OSError):
            f.write(b"x" * (1 << 20))
    with pytest.raises(OSError, match="No space left on device") as e:
        publish.replace(str(record), b"y" * 8192)  # more than its page: cannot go in place
    assert e.value.filename == str(record) and record.read_bytes() == b'{"status": "running"}'
    assert sorted(os.listdir(disk)) == ["filler", "iter-001.ppo.json"]  # no temporary file left
    publish.replace(str(record), b'{"status": "failed", "error": "no space"}')  # in its own page
    assert record.read_bytes() == b'{"status": "failed", "error": "no space"}'


def test_a_damaged_record_is_one_line_naming_it_and_the_fix(finished):
    spec, run, nodes = finished
    record = os.path.join(run, "pipeline", "iter-001.ppo.json")
    before = open(record, "rb").read()
    try:
        open(record, "wb").write(before[: len(before) // 2])
        for command in (["run", spec, "--dry-run"], ["status", run], ["run", spec]):
            r = _cli(*command)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == EXIT_USER_ERROR and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
            assert lines[-1] == f"error: {record}: damaged, not a stage's record; delete it and rerun `llamarl " \
                                f"run` (that stage then runs again)", (command, r.stderr)
    finally:
        open(record, "wb").write(before)


def test_a_trash_counted_while_it_is_emptied_holds_what_is_left(tmp_path, monkeypatch):
    # The trash thread deletes files while a stage counts them: one gone between the listing and
    # its stat holds nothing, and the rest still count (not the whole trash as 0).
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"\0" * 65536)
    listing = os.scandir

    def racing(path):
        for i, e in enumerate(listing(path)):
            if i == 1:
                os.remove(e.path)
            yield e

    monkeypatch.setattr(space.os, "scandir", racing)
    assert space._du(str(tmp_path)) == 2 * os.stat(tmp_path / sorted(os.listdir(tmp_path))[0]).st_blocks * 512
