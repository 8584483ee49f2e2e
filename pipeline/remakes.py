"""Made again as it was: an output retention deleted, rebuilt because a stage that runs needs it,
keeps its id when it holds the very files it held (docs/pipeline.md, "A long run"), so that what
was made from it stays done. What it was (``manifests``) is kept on disk beside the run's records
until the remake ends (``save_before``): a remake that fails or is stopped is still compared with
it when it runs again.
"""

from __future__ import annotations

import json

import fsspec

from llamarl.lib.files import publish


def manifests(url: str) -> dict[str, bytes]:
    """The manifests of the published output ``url`` and of its parts (``actor/``, ``train_state/
    actor/``, …), by path under ``url``: what retention kept of them when it deleted their files."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if not fs.exists(f"{path}/{publish.MANIFEST}"):
        return {}
    found = fs.glob(f"{path}/**/{publish.MANIFEST}", maxdepth=4)  # ``**`` matches no folder too: url's own
    return {p[len(path) + 1:]: fs.cat_file(p) for p in sorted(set(found))}


def _same(before: bytes, now: dict) -> bool:
    """The same output: of the same kind, the same files (each one's bytes and checksum). Its
    times and summary may differ, and so may its request, only by the ids of its inputs: a stage
    retention deleted runs again with its config unchanged (else it would not be done), on inputs
    made again before it, whose ids go back before it starts."""
    old = json.loads(before)
    return old.get("kind") == now.get("kind") and old.get("files") == now.get("files")


def keep_ids(url: str, before: dict[str, bytes]) -> bool:
    """``url`` was made again after retention deleted its files; where it holds the very files it
    held (``before``: its ``manifests`` then), every one of its manifests goes back, so it keeps
    its output id and what was made from it stays current (its key names that id). All or none: a
    parent's manifest names its parts' ids, so a part put back under a new parent would not be the
    part the parent names. Whether they went back."""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    if not before:
        return False
    for rel, old in before.items():
        try:
            now = json.loads(fs.cat_file(f"{path}/{rel}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        if not _same(old, now):
            return False
    if set(manifests(url)) != set(before):  # a part it did not have, or has no more
        return False
    for rel in sorted(before, key=lambda r: (-r.count("/"), r)):  # the root's last: it names the parts
        publish.replace(f"{url.rstrip('/')}/{rel}", before[rel])
    return True


def _before_url(run: str, name: str) -> str:
    return f"{run}/pipeline/{name.replace('/', '.')}.before.json"


def save_before(run: str, name: str, made: dict[str, dict[str, bytes]]) -> None:
    """What stage ``name``'s outputs were (``manifests`` of each, by url) before it is made again."""
    text = {url: {rel: b.decode() for rel, b in found.items()} for url, found in made.items()}
    publish.replace(_before_url(run, name), json.dumps(text, indent=1).encode())


def load_before(run: str, name: str) -> dict[str, dict[str, bytes]] | None:
    """What ``save_before`` kept for ``name``, None when it is not being made again."""
    fs, path = fsspec.core.url_to_fs(_before_url(run, name))
    if not fs.exists(path):
        return None
    try:
        text = json.loads(fs.cat_file(path))
    except (UnicodeDecodeError, ValueError):
        return None  # damaged: the remake then gets a new id, which is what it would get without this
    return {url: {rel: s.encode() for rel, s in found.items()} for url, found in text.items()}


def being_remade(run: str, names: list[str]) -> set[str]:
    """Those of ``names`` that were being made again when their run stopped (``save_before`` kept
    what they were): one listing of the run's records folder, not a look per stage."""
    fs, path = fsspec.core.url_to_fs(f"{run}/pipeline")
    found = {p.rsplit("/", 1)[-1] for p in fs.glob(f"{path}/*.before.json")}
    return {n for n in names if _before_url(run, n).rsplit("/", 1)[-1] in found}


def drop_before(run: str, name: str) -> None:
    fs, path = fsspec.core.url_to_fs(_before_url(run, name))
    if fs.exists(path):
        fs.rm(path)


def remade_as_it_was(run: str, name: str, outputs: list[str]) -> bool:
    """Stage ``name`` ended done after it was made again: each of ``outputs`` gets its manifests
    back where it holds what it held (``keep_ids``), and what was kept of them goes. Whether
    ``outputs[0]``, the stage's own output, kept its id."""
    before = load_before(run, name)
    if before is None:
        return False
    kept = {url: keep_ids(url, before.get(url, {})) for url in outputs}
    drop_before(run, name)
    return kept[outputs[0]]
