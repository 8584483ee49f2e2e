"""Hostile mutations of JSON-like trees (a run spec, the rows of a prompts file) and of the bytes
they are written as, for tests/test_fuzz.py. Every choice is drawn from the ``random.Random``
passed in, so a case is a pure function of its seed.

A tree is dicts, lists and scalars. A mapping may hold a key twice: ``Again(key)`` is written as
``key`` a second time (YAML and JSON text both allow it; what a reader makes of it is the test).
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass

import yaml


@dataclass(frozen=True)
class Again:
    """A mapping key written a second time (a duplicate key in the text)."""

    key: str


NUMBERS = [0, -1, 1, 3, 2**31, 2**31 - 1, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, 1e308, -1e308,
           5e-324, -0.0, 0.5, 1e-9, math.nan, math.inf, -math.inf, True, False]
TEXTS = ["", " ", "\t\n", "x" * 5000, "y" * 300, "🦙🦙", "\u202eevil\u202c", "שלום עולם", "a\x00b", "\ud800", "x\udfff",
         "[/x]", "[bold]x[/bold]", "nosuch://x", "memory://fuzz/x", "~", "../..", "/", ".", "%s%n{0}", "${HOME}",
         "e\u0301", "0x10", "1e5", ".inf", "null", "yes", "\r\n", "\ufeff", "\x1b[31mred", "C:\\x", "a/b/../c", "🦙/" * 3]
SHAPES = [None, [], {}, [1, 2], {"a": 1}, [[[]]], {"": None}, [None], ["x", "x"], {"k": {"k": {"k": {}}}}]
UNKNOWN_KEYS = ["colour", "Name", "", " ", "🦙", "prompt", "seed", "x" * 200, "a.b", "1"]


def hostile(rng: random.Random):
    """A value of any type that is wrong almost anywhere: numbers, text, shapes."""
    return copy.deepcopy(rng.choice(rng.choice([NUMBERS, TEXTS, SHAPES])))


def near(rng: random.Random, value):
    """A value of ``value``'s own type, bent: out of range, empty, long, odd Unicode, duplicated."""
    if isinstance(value, bool):
        return rng.choice([not value, int(value), str(value).lower(), "on", None])
    if isinstance(value, (int, float)):
        return rng.choice([-value, value * 10**rng.randint(1, 40), value + 1, value - 1, 0, float(value) + 0.5,
                           math.nan, math.inf, -math.inf, str(value), [value], 2**63 + value])
    if isinstance(value, str):
        return rng.choice(["", value * 1000, value + "🦙", value + "\x00", value + "\ud800", value.upper(),
                           " " + value, value + "\n", value + "/", "\u202e" + value, value[: len(value) // 2], [value]])
    if isinstance(value, list):
        return rng.choice([[], value + value, [value], value[::-1], value[:1] * 3, [None] + value, {"0": value}])
    if isinstance(value, dict):
        return rng.choice([{}, [value], {**value, rng.choice(UNKNOWN_KEYS): 1}, {k: None for k in value}, list(value)])
    return hostile(rng)


def places(tree, at=()) -> list[tuple]:
    """The path of every value in ``tree`` (keys and list indices), the root's () first."""
    found = [at]
    if isinstance(tree, dict):
        for k, v in tree.items():
            found += places(v, at + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            found += places(v, at + (i,))
    return found


def _at(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def mutate(rng: random.Random, tree, kinds: tuple[str, ...] = ("replace", "near", "delete", "unknown", "duplicate",
                                                                 "move", "wrap")) -> tuple[object, str]:
    """``tree`` (not changed) with one mutation, and what it was."""
    tree = copy.deepcopy(tree)
    kind = rng.choice(kinds)
    where = [p for p in places(tree) if p]
    if not where:
        return hostile(rng), f"the whole tree replaced ({kind})"
    path = rng.choice(where)
    parent, key = _at(tree, path[:-1]), path[-1]
    old = parent[key]
    shown = ".".join(map(str, path))
    if kind == "replace":
        parent[key] = hostile(rng)
    elif kind == "near":
        parent[key] = near(rng, old)
    elif kind == "delete":
        del parent[key]
        return tree, f"delete {shown}"
    elif kind == "unknown":
        host, inside = (old, path) if isinstance(old, dict) else (parent, path[:-1])
        if isinstance(host, dict):
            name = rng.choice(UNKNOWN_KEYS)
            host[name] = hostile(rng)
            return tree, f"unknown key {name!r} = {_short(host[name])} in {'.'.join(map(str, inside)) or 'the top'}"
        parent[key] = hostile(rng)
    elif kind == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(old))
            return tree, f"duplicate item {shown}"
        again = Again(str(key))
        parent[again] = rng.choice([copy.deepcopy(old), near(rng, old)])
        return tree, f"duplicate key {shown}: {_short(old)}, then {_short(parent[again])}"
    elif kind == "move":  # the value under another mapping: wrong nesting
        del parent[key]
        hosts = [p for p in places(tree) if isinstance(_at(tree, p), dict) and p != path[:-1]]
        if not hosts:
            return tree, f"delete {shown}"
        to = rng.choice(hosts)
        _at(tree, to)[key if isinstance(key, str) else "moved"] = old
        return tree, f"move {shown} into {'.'.join(map(str, to)) or 'the top'}"
    elif kind == "wrap":
        parent[key] = rng.choice([[old], {"value": old}, {str(key): old}])
    return tree, f"{kind} {shown}: {_short(old)} -> {_short(parent[key])}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- writing trees as text ------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Again, lambda dumper, again: dumper.represent_str(again.key))


def to_yaml(tree, rng: random.Random) -> bytes:
    """``tree`` as YAML: flow or block style, escaped or raw Unicode (a lone surrogate is always
    escaped: UTF-8 cannot hold it)."""
    text = yaml.dump(tree, Dumper=_Dumper, sort_keys=False, allow_unicode=rng.random() < 0.5,
                     default_flow_style=rng.choice([False, None, True]), width=rng.choice([80, 10**6]))
    return text.encode("utf-8", "backslashreplace")


def to_json(value) -> str:
    """One JSON value on one line, a repeated key (``Again``) written again, NaN and Infinity as
    Python's json writes them (and reads them back), lone surrogates escaped."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k.key if isinstance(k, Again) else str(k))}: {to_json(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(to_json, value)) + "]"
    return json.dumps(value.key if isinstance(value, Again) else value)


def plain(tree):
    """``tree`` with each repeated key's value taking its first key's place (for writers that cannot
    repeat a key, Parquet)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out[k.key if isinstance(k, Again) else k] = plain(v)
        return out
    if isinstance(tree, list):
        return [plain(v) for v in tree]
    return tree.key if isinstance(tree, Again) else tree


BAD_BYTES = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf", b"\r", b"\x1a", b"\x80\x80", b"\xf4\x90\x80\x80"]


def bend_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """``data`` with one hostile edit of its bytes: an invalid UTF-8 sequence, a NUL, a stray BOM,
    a cut, a joined or doubled line, CRLF endings."""
    kind = rng.choice(["insert", "cut", "join", "double", "crlf", "blank", "truncate-line"])
    at = rng.randrange(len(data) + 1)
    if kind == "insert":
        bad = rng.choice(BAD_BYTES)
        return data[:at] + bad + data[at:], f"bytes {bad!r} inserted at byte {at}"
    if kind == "cut":
        return data[:at], f"cut after byte {at}"
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    if kind == "join" and i + 1 < len(lines):
        return b"\n".join(lines[:i] + [lines[i] + lines[i + 1]] + lines[i + 2:]), f"lines {i + 1} and {i + 2} joined"
    if kind == "double":
        return b"\n".join(lines[:i] + [lines[i], lines[i]] + lines[i + 1:]), f"line {i + 1} doubled"
    if kind == "crlf":
        return data.replace(b"\n", b"\r\n"), "CRLF line endings"
    if kind == "blank":
        return b"\n".join(lines[:i] + [rng.choice([b"", b"  ", b"\t", b"\x0c"])] + lines[i:]), f"blank line at {i + 1}"
    return b"\n".join(lines[:i] + [lines[i][: len(lines[i]) // 2]] + lines[i + 1:]), f"line {i + 1} cut in half"
