"""A ``llamarl run`` started as a user starts it, in a subprocess of its own, and its processes
checked by pid: shared by the tests that stop or kill a driver (test_driver_stop, test_resident)."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "COLUMNS": "400"}  # no wrapped lines


def start(spec: str, env: dict = ENV) -> subprocess.Popen:
    """``llamarl run SPEC`` in a session of its own (a signal sent to it reaches it alone), its
    stdout and stderr as one text stream."""
    return subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
