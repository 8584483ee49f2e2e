"""lib/runtime/background.py's Soon: a call started now, its result (or its exception) taken later."""

from __future__ import annotations

import threading
import time

import pytest

from llamarl.lib.runtime import background


def test_soon_runs_beside_the_caller_and_hands_back_its_value():
    started = threading.Event()

    def slow(x):
        started.set()
        time.sleep(0.2)
        return x * 2

    t0 = time.perf_counter()
    soon = background.Soon(slow, 21, name="test-soon")
    assert started.wait(5) and time.perf_counter() - t0 < 0.15  # the caller goes on meanwhile
    assert soon.result() == 42 and soon.done() and soon.seconds >= 0.2
    assert soon.result() == 42  # again: the same value, no second call


def test_soon_raises_its_failure_in_the_caller():
    def fails():
        raise ValueError("no tokenizer files")

    soon = background.Soon(fails)
    with pytest.raises(ValueError, match="no tokenizer files"):
        soon.result()
