"""The run's metrics rows in TensorBoard (read back with TensorBoard's own event reader) and W&B
(offline, read back from its run file with W&B's own record format): each point once, a changed
one again, a resumed driver going on where the last left off."""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import time

import pytest

from llamarl.lib.errors import UserError
from llamarl.pipeline.monitor import Monitor, check_installed
from llamarl.pipeline.spec import MetricsSpec, RunSpec

ROWS = [{"iteration": 1, "mean_score": 0.25, "kl": None, "steps": 4},
        {"iteration": 2, "mean_score": 0.5, "kl": 0.01, "steps": 4}]


def _spec(tmp_path, **metrics) -> RunSpec:
    return RunSpec(name="m", storage=str(tmp_path / "runs"), actor="a", prompts="p", metrics=MetricsSpec(**metrics))


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_each_point_once_and_a_changed_one_again(tmp_path):
    spec = _spec(tmp_path, tensorboard=str(tmp_path / "tb"))
    monitor = Monitor(spec)
    monitor.update(ROWS)
    # The validation of iteration 2 ends later: its row grows; a new iteration comes.
    monitor.update([ROWS[0], ROWS[1] | {"val_score": 0.75, "val_pass@1": 0.5}, {"iteration": 3, "mean_score": 0.625}])
    monitor.close()
    # A resumed driver (another Monitor, from the record in the run directory) sends nothing twice.
    again = Monitor(spec)
    grown = [ROWS[0], ROWS[1] | {"val_score": 0.75, "val_pass@1": 0.5}, {"iteration": 3, "mean_score": 0.625}]
    again.update(grown)
    again.close()
    assert _scalars(tmp_path / "tb")["train/mean_score"] == [(1, 0.25), (2, 0.5), (3, 0.625)]
    # Iteration 1 ran again (another value): TensorBoard forgets iteration 1 on (purge_step) and
    # is sent every point from there again, so each step has one value, as metrics.jsonl has it.
    rerun = Monitor(spec)
    rerun.update([grown[0] | {"mean_score": 0.3}] + grown[1:])
    rerun.close()
    scalars = _scalars(tmp_path / "tb")
    assert scalars["train/mean_score"] == [(1, 0.3), (2, 0.5), (3, 0.625)]
    assert scalars["val/score"] == [(2, 0.75)] and scalars["val/pass_at_1"] == [(2, 0.5)]
    assert scalars["train/kl"] == [(2, 0.01)]  # no point for a metric that is null
    # Every point once (mean_score, kl and steps: 5; then 3), then again from the changed one on (8).
    assert _events(tmp_path / "tb") == 5 + 3 + 8


def test_a_new_or_emptied_tensorboard_folder_gets_every_point(tmp_path):
    grown = [ROWS[0], ROWS[1] | {"val_score": 0.75}]
    for folder in ("tb", "moved"):
        monitor = Monitor(_spec(tmp_path, tensorboard=str(tmp_path / folder)))
        monitor.update(grown)
        monitor.close()
        assert _scalars(tmp_path / folder)["train/mean_score"] == [(1, 0.25), (2, 0.5)], folder
    for path in glob.glob(str(tmp_path / "moved" / "*")):  # emptied, to start its plots afresh
        os.remove(path)
    monitor = Monitor(_spec(tmp_path, tensorboard=str(tmp_path / "moved")))
    monitor.update(grown + [{"iteration": 3, "mean_score": 0.625}])
    monitor.close()
    assert _scalars(tmp_path / "moved")["train/mean_score"] == [(1, 0.25), (2, 0.5), (3, 0.625)]
    assert _scalars(tmp_path / "moved")["val/score"] == [(2, 0.75)]


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line(tmp_path):
    from llamarl.pipeline.checks import check_storage

    (tmp_path / "file").write_text("not a folder")
    spec = _spec(tmp_path, tensorboard=str(tmp_path / "file" / "tb"))
    with pytest.raises(UserError, match=f"metrics.tensorboard: {tmp_path / 'file'} is a file, not a folder; point "
                                        f"metrics.tensorboard at a folder$"):
        check_storage(spec)
    monitor = Monitor(spec)  # found only now (the spec's check was not made): one line, not a traceback
    with pytest.raises(UserError, match=f"^metrics.tensorboard {tmp_path / 'file' / 'tb'}: cannot write there"):
        monitor.update(ROWS)
    monitor.close()


def _events(folder) -> int:
    """Scalar events in every event file of ``folder`` (the accumulator shows only the surviving ones)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return sum(1 for path in glob.glob(f"{folder}/events.out.tfevents.*") for event in EventFileLoader(path).Load()
               if event.HasField("summary"))


def _wandb_records(run_dir: str) -> list:
    """Every record of W&B's offline run file: its 7-byte header, then LevelDB log blocks of
    32 KiB holding records (crc, length, type: full/first/middle/last) of W&B's protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/**/run-*.wandb", recursive=True)
    data, at, out, pending = open(path, "rb").read(), 7, [], b""
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # a block's trailer
            at += 32768 - at % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0:
            break
        pending += data[at + 7: at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _history(run_dir: str) -> list[dict]:
    rows = [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
            for r in _wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def _wandb_files(run_dir: str, logged: list) -> str:
    """What a failed comparison shows (it failed once in CI, never alone): every offline folder of
    the run, each with its records' types in order, and the rows read."""
    lines = [f"rows read: {logged}"]
    for folder in sorted(glob.glob(f"{run_dir}/pipeline/wandb/*run-*")):
        try:
            kinds = [r.WhichOneof("record_type") for r in _wandb_records(folder)]
        except (ValueError, OSError) as e:  # no run file, or several
            kinds = [f"unreadable: {e}"]
        lines.append(f"{os.path.basename(folder)}: {kinds}")
    return "\n".join(lines)


def test_wandb_offline_gets_the_rows_by_iteration_in_one_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = _spec(tmp_path, wandb={"project": "llamarl-test", "mode": "offline"})
    monitor = Monitor(spec)
    monitor.update(ROWS)
    monitor.close()
    first = json.load(open(f"{spec.run_dir}/pipeline/monitor.json"))["wandb"]["id"]
    time.sleep(1.1)  # W&B names a run's local folder by the second it starts: a resume within it would share it
    again = Monitor(spec)
    again.update(ROWS + [{"iteration": 3, "mean_score": 0.625}])
    again.close()
    assert json.load(open(f"{spec.run_dir}/pipeline/monitor.json"))["wandb"]["id"] == first  # resumed, same run
    runs = sorted(glob.glob(f"{spec.run_dir}/pipeline/wandb/offline-run-*-{first}"))
    logged = [h for run in runs for h in _history(run)]
    assert logged == [{"iteration": 1, "train/mean_score": 0.25, "train/steps": 4.0},
                      {"iteration": 2, "train/mean_score": 0.5, "train/kl": 0.01, "train/steps": 4.0},
                      {"iteration": 3, "train/mean_score": 0.625}], _wandb_files(spec.run_dir, logged)


def test_a_sink_whose_package_is_missing_is_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    with pytest.raises(UserError, match="spec.yaml: metrics.wandb needs the wandb package"):
        check_installed(MetricsSpec(wandb={"project": "p"}), "spec.yaml")
