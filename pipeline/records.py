"""What the run directory says of each stage: its record, its key (``node_key``: from the
declaration the stage's own skip reads too, ``stages/identity.py``), and whether it is done —
its output published, and its record holding the same key and output id (``assess``, ``plan``).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager

import fsspec

from llamarl.lib.errors import UserError
from llamarl.lib.files import publish

from .dag import Node
from .remakes import being_remade


def _record_url(run: str, name: str) -> str:
    return f"{run}/pipeline/{name.replace('/', '.')}.json"


def read_record(run: str, node: Node | str) -> dict | None:
    """The record of ``node`` (or of the node of that name), None before it first ran; one that
    is not a record (damaged outside the run: records are replaced whole) is a one-line error."""
    url = _record_url(run, node if isinstance(node, str) else node.name)
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return None
    try:
        record = json.loads(fs.cat_file(path))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        raise UserError(f"{url}: damaged, not a stage's record; delete it and rerun `llamarl run` (that stage then "
                        f"runs again)")
    return record


def write_record(run: str, node: Node, **fields) -> dict:
    record = {**(read_record(run, node) or {}), **fields}
    publish.replace(_record_url(run, node.name), json.dumps(record, indent=1).encode())
    return record


def published_id(url: str) -> str | None:
    return publish.output_id(url) if publish.read_manifest(url) is not None else None


def changed_part(url: str) -> str | None:
    """A part of the published output ``url`` (a ppo's ``actor/``, ``train_state/actor``, …) that is
    no longer the one its manifest names — deleted, say, as a damaged checkpoint's error says to —
    or None when every one is."""
    parts = (publish.read_manifest(url) or {}).get("outputs", {})
    return next((p for p, pid in parts.items() if published_id(f"{url}/{p}") != pid), None)


def published_current(n: Node) -> bool:
    """Whether ``n``'s output is published whole with the request the driver computes for it: the
    stage would find it current and do nothing (``identity.skip_if_current``), so no process need
    start. Only a stage whose request holds no facts that only it knows (score, ppo, export) can
    match; a rollout's or a shard's never does."""
    manifest = publish.read_manifest(n.out)
    if manifest is None or "request" not in manifest or publish.retired(n.out) is not None or changed_part(n.out):
        return False
    try:
        return manifest["request"] == n.declared.request()
    except FileNotFoundError:  # an input is not published (yet): nothing can be current
        return False


_checksummed: dict[str, str] | None = None  # inside ``one_look``: a listing's fingerprint with checksums


@contextmanager
def one_look():
    """Within it (a ``with`` block, or a function it decorates), an input outside the run is hashed
    once per listing (name, size, time): a plan of a 200-iteration DAG names the same prompts 200
    times and looks at them once."""
    global _checksummed
    outer = _checksummed
    _checksummed = {} if outer is None else outer
    try:
        yield
    finally:
        _checksummed = outer


def fingerprint(url: str, checksums: bool = False, timed: bool = False) -> str:
    """A content id of a file or folder outside the run: every file's name and size, and its
    modification time or, with ``checksums``, its checksum (prompts; an HF checkpoint is not hashed
    on every `llamarl run`). Replacing or editing an input in place changes it; touching or copying
    the prompts without a change does not (an HF folder's times make a needless rerun, never a
    stale result). ``timed``: the times too, as the records of an older llamarl hold them."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return "missing"
    found = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
    listing = sorted((name[len(path):], info.get("size"),
                      str(info.get("mtime") or info.get("LastModified") or info.get("ETag"))) for name, info in found.items())
    if not checksums:
        return hashlib.sha256(json.dumps([[*e, None] for e in listing]).encode()).hexdigest()[:16]
    seen = {} if _checksummed is None else _checksummed  # outside ``one_look``, nothing is kept
    memo = f"{url}\0{json.dumps(listing)}"
    if memo not in seen:
        seen[memo] = [publish.checksum(fs.unstrip_protocol(path + e[0])) for e in listing]
    entries = [[*e, c] if timed else [e[0], e[1], c] for e, c in zip(listing, seen[memo])]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def fingerprints(node: Node, timed: bool = False) -> dict[str, str]:
    # Prompts (read by rollout) are hashed whole; model folders by names, sizes and times.
    return {url: fingerprint(url, checksums=node.stage == "rollout", timed=timed) for url in node.declared.external}


def input_url(node: Node, name: str, by_name: dict[str, Node]) -> str:
    """What ``node`` reads of its input ``name``: that node's output, or the part of it in ``node.reads``."""
    sub = node.reads.get(name)
    return f"{by_name[name].out}/{sub}" if sub else by_name[name].out


def node_key(node: Node, by_name: dict[str, Node], timed: bool = False) -> str | None:
    """The node's key, or None while an input is not published yet: its config (where it runs
    aside), the output ids of what it reads of its inputs (a part's own id where it reads a part),
    and the fingerprints of its inputs from outside the run (``timed``: as an older llamarl's records
    hold them, the prompts' modification times hashed too)."""
    config = node.declared.identity
    inputs = {}
    for name in node.inputs:
        part = f"{name}/{node.reads[name]}" if name in node.reads else name
        inputs[part] = published_id(input_url(node, name, by_name))
        if inputs[part] is None:
            return None
    external = fingerprints(node, timed)
    body = json.dumps({"stage": node.stage, "config": config, "inputs": inputs, "external": external},
                      sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


REDONE = "an input will be redone"
RETIRED = "deleted by retention"  # why a done stage runs again (``plan``) …
NOT_WRITTEN = "its training state was not written (retention.train_state_every)"  # … or so


def assess(run: str, node: Node, by_name: dict[str, Node], will_run: set[str]) -> tuple[bool, str]:
    """(is it done, why), given the stages before it that ``will_run``."""
    if any(i in will_run for i in node.inputs):
        return False, REDONE
    record = read_record(run, node)
    out_id = published_id(node.out)
    key = node_key(node, by_name)
    if record is None:
        return False, "not run before"
    if record.get("status") in ("failed", "stopped"):
        return False, f"{record['status']}: {record.get('error')}"
    if record.get("status") == "running":
        job = f" as job {record['job']}" if record.get("job") else ""
        return False, f"running{job} or interrupted (started {record.get('started')})"
    if record.get("status") == "submitted":
        return False, f"submitted as job {record.get('job')} ({record.get('submitted')})"
    unfinished = next((i for i in node.reads if published_id(by_name[i].out) is None), None)
    if unfinished is not None:  # it read a part early; that stage's rerun writes the part again
        return False, f"{unfinished} is unfinished: its {node.reads[unfinished]}/ will be written again"
    if out_id is None:
        return False, "its output is missing"
    part = changed_part(node.out)
    if part is not None:
        return False, f"its {part}/ is missing, or not the one it published"
    # An older llamarl's record of a rollout: its key hashed the prompts' modification times too.
    if record.get("key") != key and not (node.stage == "rollout" and record.get("key") == node_key(node, by_name, True)):
        ran = record.get("external") or {}
        now = [fingerprints(node)] + ([fingerprints(node, timed=True)] if node.stage == "rollout" else [])
        changed = [url for url in node.declared.external if all(ran.get(url) != f[url] for f in now)]
        return False, f"{changed[0]} changed since it ran" if changed else "its config or inputs changed"
    if record.get("output_id") != out_id:
        return False, "its output was replaced"
    return True, f"done {record.get('finished')}"


def retired_parts(url: str) -> list[str]:
    """The outputs at or under ``url`` (a ppo's ``actor/``, ``train_state/actor``, …) whose files
    retention deleted, relative to ``url`` ("" for ``url`` itself)."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if not fs.exists(path):
        return []
    markers = fs.glob(f"{path}/**/{publish.RETIRED}", maxdepth=3)  # ``**`` matches no folder too: url's own
    return sorted({m.rstrip("/")[len(path):].strip("/").removesuffix(publish.RETIRED).strip("/") for m in markers})


@one_look()
def plan(run: str, nodes: list[Node], by_name: dict[str, Node]) -> dict[str, tuple[bool, str]]:
    """For every node, in DAG order: (is it done, why). A done stage whose output retention
    deleted is not done when a stage that will run reads it: it runs again first (and so does what
    it needs, back to what is still on disk). So does one that runs only if an input of it comes
    out of its remake changed (``REDONE``), when a stage that runs whatever happens reads it."""
    redo: dict[str, str] = {}
    while True:
        states, will_run = {}, set()
        for n in nodes:
            states[n.name] = (False, redo[n.name]) if n.name in redo else assess(run, n, by_name, will_run)
            if not states[n.name][0]:
                will_run.add(n.name)
        needed = {}
        for n in nodes:
            done, why = states[n.name]
            if done:
                continue
            for i in n.inputs:
                maybe = states[i] == (False, REDONE) and why != REDONE
                gone = retired_parts(input_url(n, i, by_name)) if (states[i][0] or maybe) and i not in needed else []
                if gone:
                    unwritten = all(publish.unwritten(f"{input_url(n, i, by_name)}/{p}") for p in gone)
                    needed[i] = f"{NOT_WRITTEN if unwritten else RETIRED}, and {n.name} needs it"
        if not needed:
            return _unless_as_it_was(run, nodes, by_name, states, redo)
        redo |= needed


def _unless_as_it_was(run: str, nodes: list[Node], by_name: dict[str, Node], states: dict, redo: dict) -> dict:
    """``states`` with the stages that are done but for inputs that only retention's remakes redo
    said so: a remake that comes out as it was keeps its id (pipeline/schedule.py), and they are
    skipped then — which only the remake can tell."""
    remade = set(redo) | being_remade(run, [n.name for n in nodes])
    for n in nodes:
        done, why = states[n.name]
        if not done and why == REDONE and all(i in remade for i in n.inputs if not states[i][0]) \
                and assess(run, n, by_name, set())[0]:
            remade.add(n.name)
            states[n.name] = (False, f"{REDONE}; skipped if what retention deleted is made again as it was")
    return states


def must_redo(run: str, nodes: list[Node], by_name: dict[str, Node]) -> dict[str, str]:
    """The done stages that must run again, and why: retention deleted what a stage that runs
    needs, or its ppo did not write it (retention.train_state_every)."""
    return {name: why for name, (done, why) in plan(run, nodes, by_name).items()
            if not done and why.startswith((RETIRED, NOT_WRITTEN))}
