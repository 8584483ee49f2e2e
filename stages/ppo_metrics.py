"""ppo's metrics as JSON: its ``metrics.jsonl`` (one object per optimizer step), the steps' metrics
in a saved state's ``done.json``, and the run's ``metrics.jsonl`` (one object per iteration,
pipeline/metrics.py). Torch-free: the driver writes the run's.

JSON has no NaN or Infinity; Python's ``json`` writes them as bare words that strict parsers
(JavaScript's ``JSON.parse``, Go's ``encoding/json``, Rust's ``serde_json``) refuse. A metric that is
undefined — one that does not apply, like ``value_loss`` without a critic, or a mean over no
values — or not finite is written as ``null``, and the encoder refuses anything else that is not
JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None, through lists and mappings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """``value`` as strict JSON (non-finite floats as null)."""
    return json.dumps(finite_or_null(value), allow_nan=False)


def json_lines(rows: list[dict]) -> bytes:
    """``rows`` as JSON Lines, one object a line."""
    return "".join(dumps(r) + "\n" for r in rows).encode()


def mean(values: list) -> float | None:
    """The mean of the values that are defined (not None, finite), or None when there is none."""
    defined = [v for v in values if v is not None and math.isfinite(v)]
    return sum(defined) / len(defined) if defined else None
