"""Retention: what of a finished iteration is deleted as the run goes on (the spec's ``retention``;
docs/pipeline.md, "A long run", says what goes when and why): an output only once every stage that
reads it is done, through ``publish.retire``, which keeps its manifest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading

import fsspec

from llamarl.lib.files import publish

from .dag import VALIDATE, Node
from .records import assess, one_look, read_record, retired_parts
from .spec import RunSpec


def _consumers(nodes: list[Node]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {n.name: [] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            found[i].append(n.name)
    return found


def _why(spec: RunSpec) -> str:
    r = spec.retention
    kept = [f"keep_last: {r.keep_last}"] if r.keep_last is not None else []
    kept += [f"keep_every: {r.keep_every}"] if r.keep_every else []
    kept += ["keep_samples: false"] if not r.keep_samples else []
    return "retention " + ", ".join(kept)


class Trash:
    """Where retention moves what it deletes while ``llamarl run`` runs (local storage only), emptied
    by a thread of its own: deleting a training state's GBs takes seconds that the next stage need
    not wait for unless it needs the room — its free-space check then waits for the trash
    (``publish.TRASH_ENV``, set for the stages while the trash is open). ``close`` empties it; a killed run's is emptied by the next."""

    def __init__(self, run_dir: str):
        self.path = f"{run_dir}/pipeline/trash"
        self._wake, self._closing = threading.Event(), False
        self._thread = threading.Thread(target=self._empty, name="trash", daemon=True)
        self._thread.start()
        self._env = os.environ.get(publish.TRASH_ENV)
        os.environ[publish.TRASH_ENV] = self.path

    @staticmethod
    def open(run_dir: str) -> Trash | None:
        fs, path = fsspec.core.url_to_fs(run_dir)
        return Trash(path) if "file" in fs.protocol else None

    def empty_soon(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join()
        if self._env is None:
            os.environ.pop(publish.TRASH_ENV, None)
        else:
            os.environ[publish.TRASH_ENV] = self._env

    def _empty(self) -> None:
        while True:
            closing = self._closing
            # Never raises: a thread that died here would leave the trash, and the disk, full.
            for entry in os.scandir(self.path) if os.path.isdir(self.path) else []:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(entry.path)
            if closing:
                return
            self._wake.wait()
            self._wake.clear()


@one_look()
def retire_done(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], echo=print,
                trash: Trash | None = None, remaking: frozenset[str] = frozenset()) -> list[str]:
    """Delete what retention lets go of now (into ``trash`` when given); returns the outputs (or
    parts) deleted. ``remaking``: the stages this run makes again because retention deleted what
    a stage that runs needs: not done (their retired outputs keep their ids), until they are."""
    r, run = spec.retention, spec.run_dir
    if r.keep_last is None and r.keep_samples:
        return []
    consumers = _consumers(nodes)

    @functools.cache
    def done(name: str) -> bool:
        return name not in remaking and assess(run, by_name[name], by_name, set())[0]

    def all_read(n: Node) -> bool:
        return done(n.name) and all(done(c) for c in consumers[n.name])

    goes: list[str] = []
    ppos = [n for n in nodes if n.stage == "ppo"]
    if r.keep_last is not None:
        finished = [n.iteration for n in ppos if done(n.name)]
        newest = max(finished, default=0)
        start = _restart_from(spec, ppos, done)
        for n in ppos:
            if n.iteration > newest - r.keep_last or not all_read(n):
                continue
            if start - spec.max_staleness <= n.iteration <= start:
                continue  # what a rerun makes the iterations after it again from
            kept_actor = r.keep_every and n.iteration % r.keep_every == 0
            parts = (publish.read_manifest(n.out) or {}).get("outputs", {})  # actor, critic, train_state/actor, …
            goes += [f"{n.out}/{part}" for part in sorted(parts) if not (kept_actor and part == "actor")]
    if not r.keep_samples:
        for n in nodes:
            if n.stage not in ("rollout", "score") or not all_read(n):
                continue
            if n.role == VALIDATE and n.stage == "score" and "metrics" not in (read_record(run, n) or {}):
                continue  # its metrics are read from it first
            goes.append(n.out)
    into = trash.path if trash else None
    deleted = [url for url in goes if publish.retire(url, _why(spec), keep=(), trash=into)]
    for url in deleted:
        echo(f"[retention] deleted {url[len(run) + 1:]} ({_why(spec)})")
    if trash is not None and deleted:
        trash.empty_soon()
    return deleted


def _restart_from(spec: RunSpec, ppos: list[Node], done) -> int:
    """The iteration whose ppo output a rerun after a crash makes the later ones again from, under
    retention.train_state_every: the newest done one whose training state is written (0: the
    shard); its actor, and the ``max_staleness`` before it that the next rollouts sample from, stay
    whole. None is needed where every state is written (-1)."""
    from llamarl.stages import contract

    if spec.retention.train_state_every == 1:
        return -1
    written = [n.iteration for n in ppos if done(n.name)  # and its state whole: neither unwritten nor deleted
               and publish.retired(f"{n.out}/{contract.TRAIN_STATE}/{contract.ACTOR}") is None]
    return max(written, default=0)


def retained(n: Node) -> str:
    """What retention deleted of ``n``'s output, in words for ``llamarl status`` ("" when nothing)."""
    gone = retired_parts(n.out)
    if not gone:
        return ""
    if gone == [""]:
        return "its files were deleted (retention)"
    unwritten = [g for g in gone if publish.unwritten(f"{n.out}/{g}")]
    deleted = [g for g in gone if g not in unwritten]
    words = [f"deleted by retention: {', '.join(g + '/' for g in deleted)}"] if deleted else []
    words += [f"not written: {', '.join(g + '/' for g in unwritten)} (retention.train_state_every)"] if unwritten else []
    return "; ".join(words)
