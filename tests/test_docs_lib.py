"""The docs name what exists: docs/lib.md maps every module of lib/, and no doc names a file that is
gone (fast: reads text only).

A path counts where a doc writes it from the repository root (``lib/files/checkpoint.py``,
``stages/ppo_trainer.train_step`` for a module's attribute, ``bench/results/``), as a module's
dotted name (``llamarl.lib.model.layers``, ``lib.model.schedule.forward_backward``), or as a
relative link between docs (``](generation.md)``). docs/lib.md may also name lib/'s modules
relative to lib/ (``model/attention.py``).
"""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
LIB_MAP = os.path.join(ROOT, "docs", "lib.md")

# A path from the repository root, not inside a longer path or name (``RUN/pipeline/…``, ``x.lib/``).
ROOT_PATH = re.compile(r"(?<![\w/.$~-])((?:lib|stages|pipeline|cluster|bench|tests|docs)/[\w./*{}<>-]*)")
DOTTED = re.compile(r"`((?:llamarl\.)?(?:lib|stages|pipeline|cluster)\.[\w.]+)")
LINK = re.compile(r"\]\(([\w./-]+\.md)?(?:#([\w-]+))?\)")
FILE_ENDINGS = (".py", ".md", ".sh", ".json", ".jsonl", ".txt", ".toml", ".yaml")


def _exists(path: str) -> bool:
    """Whether ``path`` (from the root) is a file or folder, or ``module.attribute`` of a module."""
    path = path.rstrip(".,;:)").split("::")[0]
    if os.path.exists(os.path.join(ROOT, path)):
        return True
    folder, _, last = path.rpartition("/")
    if "." in last and not last.endswith(FILE_ENDINGS):  # stages/ppo_trainer.train_step
        return os.path.isfile(os.path.join(ROOT, folder, last.split(".")[0] + ".py"))
    return False


def _anchors(doc: str) -> set[str]:
    """The anchors GitHub gives a doc's headings: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", open(doc).read(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _link_missing(doc: str, target: str | None, anchor: str | None) -> bool:
    path = os.path.join(os.path.dirname(doc), target) if target else doc
    if not os.path.exists(path):
        return True
    return bool(anchor) and anchor not in _anchors(path)


def _dotted_exists(ref: str) -> bool:
    """``lib.model.llama.DecoderLayer``: packages down to a module; what follows it is its attribute."""
    parts = ref.split(".")[1:] if ref.startswith("llamarl.") else ref.split(".")
    here = ROOT
    for part in parts:
        if os.path.isfile(os.path.join(here, part + ".py")):
            return True
        if not os.path.isdir(os.path.join(here, part)):
            return False
        here = os.path.join(here, part)
    return True


def _missing(doc: str) -> list[str]:
    text = open(doc).read()
    missing = []
    for m in ROOT_PATH.finditer(text):
        path = m.group(1).rstrip(".,;:)")
        if any(c in path for c in "*{}<>"):
            continue  # a pattern (stages/<name>.py, results-*.json), not one path
        if path.startswith("pipeline/") and not path.endswith(".py"):
            continue  # a run directory's pipeline/ (lock.json, spec.yaml): the source pipeline/ holds modules
        if not _exists(path):
            missing.append(path)
    missing += [m.group(1) for m in DOTTED.finditer(text) if not _dotted_exists(m.group(1))]
    missing += [m.group(0)[2:-1] for m in LINK.finditer(text)
                if (m.group(1) or m.group(2)) and _link_missing(doc, m.group(1), m.group(2))]
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: os.path.relpath(d, ROOT))
def test_every_path_a_doc_names_exists(doc):
    missing = _missing(doc)
    assert not missing, f"{os.path.relpath(doc, ROOT)} names what does not exist: {', '.join(sorted(set(missing)))}"


def _lib_modules() -> list[str]:
    """lib/'s modules relative to lib/ (``model/attention.py``), ``__init__`` files left out."""
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "lib")):
        found += [os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "lib")) for f in files
                  if f.endswith(".py") and f != "__init__.py"]
    return sorted(p.replace(os.sep, "/") for p in found)


def _named_in_lib_map() -> set[str]:
    """The ``.py`` paths docs/lib.md writes in backticks, relative to lib/ where they start with lib/."""
    names = set()
    for token in re.findall(r"`([\w./-]+\.py)", open(LIB_MAP).read()):
        names.add(token.removeprefix("lib/"))
    return names


def test_the_lib_map_names_every_module_of_lib():
    named = _named_in_lib_map()
    unnamed = [m for m in _lib_modules() if m not in named]
    assert not unnamed, f"docs/lib.md does not name {', '.join(unnamed)}: add a row to its folder's table"


def test_the_lib_map_names_no_module_that_is_gone():
    gone = [n for n in sorted(_named_in_lib_map())
            if not os.path.isfile(os.path.join(ROOT, "lib", n)) and not os.path.isfile(os.path.join(ROOT, n))]
    assert not gone, f"docs/lib.md names {', '.join(gone)}: no such module under lib/ (nor from the root)"


def test_the_checks_catch_a_stale_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See `lib/parallel.py`, lib/files/checkpoint.py, `lib.schedule.forward_backward`, "
                   "`lib.model.schedule.forward_backward`, stages/ppo_trainer.train_step, lib/job.execute, "
                   "RUN/pipeline/lock.json, [x](nowhere.md), [y](#the-title), [z](x.md#gone).\n# The title\n")
    assert sorted(_missing(str(doc))) == ["lib.schedule.forward_backward", "lib/job.execute", "lib/parallel.py",
                                          "nowhere.md", "x.md#gone"]
