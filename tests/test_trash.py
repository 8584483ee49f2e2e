"""Retention's trash: what `llamarl run` deletes is moved aside at once and deleted by a thread
beside the next stage (pipeline/retention.py ``Trash``), which counts it as free meanwhile."""

from __future__ import annotations

import os
import threading

from llamarl.lib.files import publish
from llamarl.pipeline.retention import Trash


def _published(root) -> str:
    root = str(root)
    publish.prepare(root, lambda m: False)
    os.makedirs(f"{root}/optim")
    with open(f"{root}/optim/state.bin", "wb") as f:
        f.write(b"\0" * 4096)
    publish.write_bytes(f"{root}/metrics.jsonl", b"{}\n")
    publish.publish(root, {"kind": "test", "files": {}})
    return root


def test_retire_into_a_trash_moves_the_files_and_keeps_the_manifest(tmp_path):
    root, trash = _published(tmp_path / "out"), str(tmp_path / "trash")
    before = publish.output_id(root)
    assert publish.retire(root, "retention keep_last: 1", trash=trash)
    assert sorted(os.listdir(root)) == sorted([publish.MANIFEST, publish.RETIRED])
    assert publish.output_id(root) == before and publish.retired(root)["why"] == "retention keep_last: 1"
    assert len(os.listdir(trash)) == 2  # optim/ and metrics.jsonl, each under a name of its own
    assert not publish.retire(root, "again", trash=trash)  # retired already


def test_the_trash_is_emptied_beside_and_whole_at_close(tmp_path, monkeypatch):
    monkeypatch.setenv(publish.TRASH_ENV, "/elsewhere")
    run = tmp_path / "run"
    leftover = run / "pipeline" / "trash" / "from-a-killed-run"
    leftover.mkdir(parents=True)
    trash = Trash.open(str(run))
    assert os.environ[publish.TRASH_ENV] == trash.path  # what the stages started now see
    root = _published(tmp_path / "out")
    publish.retire(root, "retention", trash=trash.path)
    trash.empty_soon()
    names = [t.name for t in threading.enumerate()]
    assert "trash" in names
    trash.close()
    assert os.listdir(trash.path) == [] and not leftover.exists()
    assert os.environ[publish.TRASH_ENV] == "/elsewhere" and "trash" not in [t.name for t in threading.enumerate()]


def test_no_trash_on_an_object_store():
    assert Trash.open("memory://run") is None


def test_a_file_the_trash_cannot_delete_leaves_it_emptying(tmp_path, monkeypatch):
    from llamarl.pipeline import retention

    trash = Trash.open(str(tmp_path / "run"))
    os.makedirs(trash.path, exist_ok=True)
    stuck = os.path.join(trash.path, "stuck")
    open(stuck, "wb").close()
    real_remove = os.remove
    monkeypatch.setattr(retention.os, "remove", lambda p: (_ for _ in ()).throw(PermissionError(p))
                        if p == stuck else real_remove(p))
    trash.empty_soon()
    root = _published(tmp_path / "out")
    publish.retire(root, "retention", trash=trash.path)
    trash.close()  # the thread lived on, and emptied what came after
    assert os.listdir(trash.path) == ["stuck"]
