"""ppo's metrics as strict JSON, torch-free: its ``metrics.jsonl``, a saved state's ``done.json``
and the run's ``metrics.jsonl`` (pipeline/metrics.py). JSON has no NaN or Infinity (strict parsers
refuse the bare words Python's ``json`` writes), so an undefined or non-finite metric is ``null``.
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
    return "".join(dumps(r) + "\n" for r in rows).encode()


def mean(values: list) -> float | None:
    """The mean of the values that are defined (not None, finite), or None when there is none."""
    defined = [v for v in values if v is not None and math.isfinite(v)]
    return sum(defined) / len(defined) if defined else None
