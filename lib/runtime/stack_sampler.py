"""Where a stage process's threads spend their time: every thread's Python stack, sampled.

``LLAMARL_STACKS_DIR`` set, a stage process (``job.main``) runs a ``StackSampler`` for its whole
life and writes ``rank-<RANK>-<PID>.stacks.jsonl`` there (a run's stages share the folder): one line per sample of a thread that was not
idle, ``[unix time, thread name, "file:function:line;…" (outermost first)]``. The times let a
reader cut the samples by the manifest's ``spans_s`` (``bench/rollout_stage.py --stacks``).

A thread here rather than py-spy: nothing to install on a GPU machine, and the samples carry the
thread names (``rollout-tokenizer``, …). The cost: the sampler takes the interpreter lock once
per interval (5 ms by default) for a few tens of microseconds. A thread blocked in a wait (a lock,
a queue, a socket, ``time.sleep``) is idle and not written; one blocked in native code that holds
no Python frame of its own above a known wait shows as its innermost Python frame.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

STACKS_ENV = "LLAMARL_STACKS_DIR"

# Innermost frames of a thread that is waiting, not working.
_IDLE = {("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"), ("queue.py", "get"),
         ("selectors.py", "select"), ("socket.py", "accept"), ("thread.py", "_worker"),
         ("stack_sampler.py", "_run")}


class StackSampler:
    def __init__(self, path: str, interval_s: float = 0.005):
        self.path, self.interval_s = path, interval_s
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.time()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) in _IDLE:
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                self.samples.append((now, names.get(ident, str(ident)), ";".join(reversed(stack))))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:  # a resident worker's stages share its pid: each adds its own
            for s in self.samples:
                f.write(json.dumps(s) + "\n")


def from_env() -> StackSampler | None:
    """A started sampler when ``LLAMARL_STACKS_DIR`` is set, else None."""
    folder = os.environ.get(STACKS_ENV)
    if not folder:
        return None
    return StackSampler(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}-{os.getpid()}.stacks.jsonl"))
