"""Rule-based rewards chosen by name in the score config: ``fn(response: str, row: dict, **args)
-> float``, built in (``BUILTIN``) or any importable function named ``package.module:function``.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

from llamarl.lib.errors import UserError

Rule = Callable[..., float]


def _normalize(text: str) -> str:
    return " ".join(str(text).lower().split()).strip(" .!?")


def exact_match(response: str, row: dict, column: str = "answer", normalize: bool = True) -> float:
    """1 if the response equals the row's reference (case, spacing and final punctuation ignored)."""
    ref = row[column]
    return float(_normalize(response) == _normalize(ref) if normalize else response == ref)


def contains(response: str, row: dict, column: str = "answer") -> float:
    """1 if the row's reference appears in the response (case-insensitive)."""
    return float(_normalize(row[column]) in _normalize(response))


def regex(response: str, row: dict, pattern: str, full: bool = False) -> float:
    """1 if the response matches ``pattern`` (anywhere, or whole with ``full``)."""
    return float(bool((re.fullmatch if full else re.search)(pattern, response, flags=re.DOTALL)))


def length(response: str, row: dict, target: int = 64, scale: float = 64.0, unit: str = "tokens") -> float:
    """``-|length - target| / scale``; length in response tokens (``unit: tokens``) or characters."""
    n = len(row["response_token_ids"]) if unit == "tokens" else len(response)
    return -abs(n - target) / scale


BUILTIN: dict[str, Rule] = {"exact_match": exact_match, "contains": contains, "regex": regex, "length": length}


def check_args(name: str, args: dict) -> None:
    """What a built-in rule's ``args`` (bound to its signature and typed already) must also be, or a
    ``ValueError`` saying why: checked when a config is built, not at the first row it scores."""
    if name == "regex":
        try:
            re.compile(args["pattern"], flags=re.DOTALL)
        except re.error as e:
            raise ValueError(f"pattern={args['pattern']!r} is no regular expression ({e})") from None


def resolve(name: str) -> Rule:
    """A rule by built-in name or ``module:function`` path."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        module, func = name.split(":", 1)
        try:
            return getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as e:
            raise UserError(f"reward rule {name!r} cannot be imported ({e}); check the module path") from None
    raise UserError(f"unknown reward rule {name!r}; use 'rm', one of {', '.join(BUILTIN)}, or 'module:function'")
