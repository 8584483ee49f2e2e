"""A pool of N processes joined in one gloo process group, kept alive across tests.

``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank (``fn`` must be importable: a module-level
function) and returns the per-rank results. Starting processes and importing torch,
transformers and megatron-core costs seconds, so tests share one pool per world size. A rank
that raises fails the call with its traceback; the pool is then torn down (peers may be stuck in
a collective) and the next call starts a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback

import torch.multiprocessing as mp

_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    def __init__(self, world: int):
        self.world = world
        self._procs = None

    def _start(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world, port, self._tasks[r], self._results), daemon=True)
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args) -> list:
        if self._procs is None:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        out, errors = [None] * self.world, []
        try:
            for _ in range(self.world):
                rank, ok, value = self._results.get(timeout=_TIMEOUT_S)
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break
        except Exception as e:  # queue.Empty: a rank hung
            errors.append(f"no answer within {_TIMEOUT_S}s ({e!r})")
        if errors:
            self.close()
            raise RuntimeError("distributed task failed\n" + "\n".join(errors))
        return out

    def close(self):
        if self._procs is None:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def interpreter_pool(n):
    """On CPU Triton kernels run in Triton's interpreter, which must be chosen before Triton is
    first imported: in a pool of fresh processes started with ``TRITON_INTERPRET=1``."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    pool = DistPool(n)
    try:
        yield pool
    finally:
        pool.close()
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
