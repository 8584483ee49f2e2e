"""Work beside the caller, in a thread: an iterator read ahead of its consumer (``Ahead``), a
function applied behind its producer (``Behind``), each a bounded queue away, and one call started
now whose result is taken later (``Soon``); how rollout overlaps its host work with the device
through them: docs/generation.md. Failures reach the caller, at the item where they happened;
nothing waits forever on a thread that has failed."""

from __future__ import annotations

import queue
import threading
import time


class Ahead:
    """An iterator run ``depth`` items ahead of its consumer, in a thread; its exception is raised
    in the consumer, at the item where it happened."""

    _END = object()

    def __init__(self, items, depth: int, name: str = "ahead"):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(items),), name=name, daemon=True)
        self._thread.start()

    def _run(self, items) -> None:
        try:
            for item in items:
                if not self._offer((item, None)):
                    return
            self._offer((self._END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._offer((self._END, e))

    def _offer(self, entry) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        while True:
            item, error = self._queue.get()
            if error is not None:
                raise error
            if item is self._END:
                return
            yield item

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


class Behind:
    """``fn(item)`` for each item put, in order: in a thread of its own at most ``depth`` items
    behind the caller (``background``), or at once. The first failure is raised by the next
    ``put`` or by ``close`` (which waits for the rest); the items after it are not processed."""

    _END = object()

    def __init__(self, fn, depth: int, background: bool, name: str = "behind"):
        self._fn, self._error = fn, None
        self._queue: queue.Queue = queue.Queue(depth)
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not self._END:
            if self._error is None:
                try:
                    self._fn(item)
                except BaseException as e:  # noqa: BLE001 - raised in the caller
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, item) -> None:
        if self._thread is None:
            self._fn(item)
            return
        while True:
            self._raise()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def close(self) -> None:
        """Wait for every item; raise the first failure."""
        self.stop()
        self._raise()

    def stop(self) -> None:
        """After a failure of the caller: the items queued are still processed (whole parts are
        kept for a rerun), then the thread ends."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(self._END)
            self._thread.join()


class Soon:
    """``fn(*args)`` started now in a thread of its own; ``result()`` waits for it and returns its
    value or raises its exception, in the caller."""

    def __init__(self, fn, *args, name: str = "soon"):
        self._value, self._error, self.seconds = None, None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        t = time.perf_counter()
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            self._error = e
        self.seconds = time.perf_counter() - t

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
