"""A resident stage worker (``python -m llamarl.cluster.worker``), started by the local executor
with ``resident: true`` (cluster/resident.py): one process per rank, running stage after stage.

Each request is one JSON line on its stdin: ``{"warm": [MODULE, …]}`` imports those modules,
``{"prepare": REQUEST}`` gets ready for a stage that comes next; neither is answered. Any other
names the stage, its arguments (those of ``python -m llamarl.stages.STAGE``) and the environment
its process would get; the worker runs it as a stage process does (``job.call``), then writes
``END STATUS`` on stderr after everything the stage printed there, so that the executor never has
the status without the error line. A worker leaves after a stage that ended in anything but
success or a user error (its state is not to be trusted), when its stdin closes, and with the
driver (``PARENT_ENV``).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
from contextlib import suppress

END = "\x1fllamarl-worker-end"
"""Starts the line a worker writes on stderr when a stage's call has ended: ``END STATUS``."""


def main() -> None:
    from llamarl.lib.errors import EXIT_USER_ERROR
    from llamarl.lib.runtime import job

    job.die_with_parent()
    # The requests come on a descriptor of its own: what a stage starts (a tokenizer process, a
    # reward rule's sandbox) inherits fd 0 as /dev/null and can never read a request.
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    code = 0
    for line in requests:
        request = json.loads(line)
        if "warm" in request:
            warm(request["warm"])
            continue
        if "prepare" in request:
            prepare(request["prepare"])
            continue
        code = serve(request)
        sys.stdout.flush()
        sys.stderr.write(f"{END} {code}\n")
        sys.stderr.flush()
        if code not in (0, EXIT_USER_ERROR):
            break
    # As a stage process leaves (lib/runtime/job.py ``main``): without the interpreter's teardown.
    os._exit(code if code not in (0, EXIT_USER_ERROR) else 0)


def warm(modules: list[str]) -> None:
    """Import the stages' modules ahead of their first call (a spare worker, started while another
    stage runs, that a stage beside it takes next). Nothing is reported: a module that fails to
    import fails its stage's call, in one line or with its traceback, as it would there."""
    import importlib

    for name in modules:
        with suppress(Exception):  # the call reports it
            importlib.import_module(name)
    # What the imports made lives as long as the worker: the collection at the end of every call
    # (``serve``) need not walk it again (a tenth to a fifth of a second a call, on the critical path).
    gc.collect()
    gc.freeze()


def prepare(request: dict) -> None:
    """Get ready for the stage of ``request`` (``Executor.prepare``): import it and run its
    ``prepare(config)`` where it has one (ppo compiles its kernels). A failure costs only the head
    start: one line says so, and the stage's call reports whatever fails again."""
    from llamarl.lib.runtime import job
    from llamarl.stages.config import STAGES

    stage = request["stage"]
    try:
        module = _enter(request)
        if hasattr(module, "prepare"):
            module.prepare(job.load_config(STAGES[stage], request["argv"]))
    except BaseException as e:  # noqa: BLE001 - the stage's call reports it, where it matters
        first = (str(e).splitlines() or [""])[0][:200]
        print(f"note: getting {stage} ready failed ({type(e).__name__}: {first}); it starts without that",
              file=sys.stderr, flush=True)
    gc.collect()  # what it built (a model, its compiled graphs' inputs) goes before the memory is given back
    _give_back()


def serve(request: dict) -> int:
    """Run the stage of ``request`` in this process; its exit status (1 for a bug, whose
    traceback goes to stderr, as a stage process's does)."""
    from llamarl.lib.runtime import job
    from llamarl.stages.config import STAGES

    started = time.time()
    stage = request["stage"]
    try:
        module = _enter(request)
        code = job.call(STAGES[stage], module.run, request["argv"], started=started)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: its traceback, as the interpreter would print it
        traceback.print_exc()
        code = 1
    # A stage process ends after the threads of its own that still write (a background writer):
    # so does the call. Thread pools nobody holds any more are collected first: their idle threads
    # then leave (a process's exit wakes them the same way).
    gc.collect()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon and thread.is_alive():
            thread.join()
    _give_back()
    return code


def _enter(request: dict):
    """The environment the stage's process would have, and the stage's module."""
    import importlib

    os.environ.clear()
    os.environ.update(request["env"])
    return importlib.import_module(f"llamarl.stages.{request['stage']}")


def _give_back() -> None:
    """What a stage process's exit gives back, the worker gives back too: the GPU memory its caching
    allocator holds, which another stage's process on the same GPU may need. The context stays."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
