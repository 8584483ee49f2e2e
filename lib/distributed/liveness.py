"""Which peer was lost: a heartbeat of every rank in the job's rendezvous store.

When a host dies mid-stage, the survivors' failed collective ("Timed out waiting 600000ms for
recv operation") does not say who is gone. So each rank bumps a counter in the rendezvous store
(the TCPStore rank 0 hosts) every ``INTERVAL_S``; a rank whose collective failed reads the
counters twice, ``2 * INTERVAL_S`` apart, and names the ranks whose counters stood still.
Counters, not timestamps: hosts' clocks need not agree. When rank 0's host is the one lost,
nothing can be read, and the message says so.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
from contextlib import suppress

import torch.distributed as dist

INTERVAL_S = 1.0

_beat: _Heartbeat | None = None


class _Heartbeat(threading.Thread):
    def __init__(self, store, rank: int, world: int):
        super().__init__(name="llamarl-heartbeat", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.stopped = threading.Event()

    def run(self) -> None:
        host = socket.gethostname()
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            ip = "?"
        with suppress(Exception):  # the store is gone (rank 0's host lost, or the job ending): nothing to beat into
            self.store.set(f"who/{self.rank}", f"{host} ({ip})")
            while not self.stopped.is_set():
                self.store.add(f"beat/{self.rank}", 1)
                self.stopped.wait(INTERVAL_S)


def start() -> None:
    """Start this rank's heartbeat (after ``init_process_group``; a no-op for one process)."""
    global _beat
    stop()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.PrefixStore("llamarl/liveness/", dist.distributed_c10d._get_default_store())
    _beat = _Heartbeat(store, dist.get_rank(), dist.get_world_size())
    _beat.start()


def stop() -> None:
    """End this rank's heartbeat and wait for it. Waiting matters at exit: a daemon thread inside a
    store call (the GIL released) when the interpreter finalizes aborts the whole process
    ("terminate called without an active exception", pytorch#38228), so ``stop`` runs at exit too."""
    global _beat
    beat, _beat = _beat, None
    if beat is not None:
        beat.stopped.set()
        beat.join(timeout=2 * INTERVAL_S + 1.0)


atexit.register(stop)


def lost_ranks() -> str | None:
    """Who stopped beating, e.g. ``rank 1 on host2 (10.0.0.2)``; None when all beat, or when no
    heartbeat ran. Takes about ``2 * INTERVAL_S``."""
    beat = _beat
    if beat is None:
        return None
    beat.stopped.set()  # our own counter stops too: we are leaving
    store = beat.store
    try:
        store.set_timeout(datetime.timedelta(seconds=2 * INTERVAL_S))
        keys = [f"beat/{r}" for r in range(beat.world)]
        first = [store.add(k, 0) for k in keys]
        time.sleep(2.5 * INTERVAL_S)
        second = [store.add(k, 0) for k in keys]
    except Exception:
        master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return f"rank 0's host ({master}), which holds the job's rendezvous store"
    gone = [r for r in range(beat.world) if r != beat.rank and first[r] == second[r]]
    if not gone:
        return None
    names = []
    for r in gone:
        try:
            who = store.get(f"who/{r}").decode() if store.check([f"who/{r}"]) else "a host that never beat"
        except Exception:
            who = "?"
        names.append(f"rank {r} on {who}")
    return ", ".join(names)
