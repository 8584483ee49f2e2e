"""Where the seconds of ppo's training-state write go: our writer against its parts, one process.

    python bench/state_write.py [--gb 16] [--tensors 64] [--workdir DIR]

The state is ``--tensors`` fp32 tensors on the device, ``--gb`` in all (the 1B shape's state is
about 17 GB: fp32 masters and two Adam moments). Each row writes (or only moves) all of it:

  checkpoint.save   what ppo does: ``checkpoint.save(state, url, threads=8)`` (a pinned buffer per
                    item, D2H, ``torch.save`` through the hashing writer, 8 files at once);
                    (``again``: a second time, torch's pinned host blocks cached);
  d2h               only the copies to pinned host memory (8 threads, one buffer each, reused);
  xxh3              only the hash of host memory (1 and 8 threads);
  …from host        checkpoint.save of the same state in pinned host memory: no D2H;
  hashing writer    the host state's bytes through ``publish.open_write`` (8 files): no torch.save;
  raw write         pinned host buffers written to files with ``os.write`` (1 and 8 threads), no
                    hash, no D2H; ``+fsync`` also waits for the disk.

``--rounds N`` then writes the state N times more as ppo's iterations do: a gap of ``--gap`` s
between writes (the update), and the state before deleted once the next is written (keep-last-1),
each write timed: how far a run's earlier writes, still on their way to the disk, slow the next;
``--free-pinned`` gives torch's cached pinned host blocks back after each, which otherwise stay
(about the state's size) and leave the page cache that much less.

with the page-cache settings (``/proc/sys/vm/dirty_*``) and the disk's free space. Writes JSON to
bench/results/state_write-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from handoff import device_name  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw_write(bufs: list[torch.Tensor], folder: str, threads: int, fsync: bool) -> None:
    def one(i: int) -> None:
        fd = os.open(f"{folder}/raw_{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for b in bufs[i::threads]:
                view = memoryview(b.numpy()).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))


def hashed_write(bufs: list[torch.Tensor], folder: str, threads: int) -> None:
    from llamarl.lib.files import publish

    def one(i: int) -> None:
        with publish.open_write(f"{folder}/hashed_{i}") as f:
            for b in bufs[i::threads]:
                f.write(memoryview(b.numpy()).cast("B"))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))


def d2h(state: list[torch.Tensor], threads: int) -> None:
    def one(i: int) -> None:
        host = torch.empty_like(state[0], device="cpu", pin_memory=True)
        for t in state[i::threads]:
            host.copy_(t, non_blocking=True)
            torch.cuda.current_stream().synchronize()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))


def xxh3(bufs: list[torch.Tensor], threads: int) -> None:
    import xxhash

    def one(i: int) -> None:
        for b in bufs[i::threads]:
            xxhash.xxh3_128(memoryview(b.numpy()).cast("B")).hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))


def steady(checkpoint, state: list[torch.Tensor], work: str, rounds: int, gap: float, free_pinned: bool) -> dict:
    """Each round's write, as ppo's iterations write it: ``gap`` s apart, the one before deleted
    after; with ``free_pinned``, torch's cached pinned host blocks given back after each (what a
    resident worker holds between stages otherwise, and what the page cache then lacks)."""
    times, pinned = [], []
    for r in range(rounds):
        t = timed(lambda: checkpoint.save({f"t{i}": x for i, x in enumerate(state)}, f"{work}/round-{r}", threads=8))
        times.append(round(t, 3))
        pinned.append(_pinned_gb())
        print(f"round {r}: {t:.2f} s, {pinned[-1]} GB pinned by torch's host cache", flush=True)
        if free_pinned and torch.cuda.is_available():
            empty = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
            if empty is not None:
                empty()
        if r:
            shutil.rmtree(f"{work}/round-{r - 1}")
        time.sleep(gap)
    return {"s": times, "pinned_gb": pinned, "free_pinned": free_pinned}


def _pinned_gb() -> float | None:
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    return round(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)) / 1e9, 2)


def vm_settings() -> dict:
    out = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes",
                 "dirty_expire_centisecs"):
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                out[name] = int(f.read())
        except OSError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--gap", type=float, default=10.0)
    ap.add_argument("--free-pinned", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from llamarl.lib.files import checkpoint

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(args.gb * 2**30 / 4 / args.tensors)
    state = [torch.randn(n, device=dev) for _ in range(args.tensors)]
    total = sum(t.numel() * 4 for t in state)
    work = tempfile.mkdtemp(dir=args.workdir or os.getcwd(), prefix="state-write-")
    rows: dict[str, float] = {}
    try:  # a first small save: imports and the writer's first-call costs stay out of the row
        checkpoint.save({"warm": state[0][:1024]}, f"{work}/warm", threads=8)
        shutil.rmtree(f"{work}/warm")
        for again in ("", ", again"):  # again: torch's pinned host blocks cached, as in a resident worker
            rows[f"checkpoint.save threads=8{again}"] = timed(
                lambda: checkpoint.save({f"t{i}": t for i, t in enumerate(state)}, f"{work}/ckpt", threads=8))
            shutil.rmtree(f"{work}/ckpt")
        if dev.type == "cuda":
            rows["d2h threads=8"] = timed(lambda: d2h(state, 8))
        host = [t.to("cpu").pin_memory() if dev.type == "cuda" else t for t in state]
        rows["checkpoint.save from host threads=8"] = timed(
            lambda: checkpoint.save({f"t{i}": t for i, t in enumerate(host)}, f"{work}/ckpt", threads=8))
        shutil.rmtree(f"{work}/ckpt")
        rows["hashing writer threads=8"] = timed(lambda: hashed_write(host, work, 8))
        for f in os.listdir(work):
            os.remove(f"{work}/{f}")
        for th in (1, 8):
            rows[f"xxh3 threads={th}"] = timed(lambda th=th: xxh3(host, th))
        for th in (1, 8):
            for fsync in (False, True):
                key = f"raw write threads={th}{' +fsync' if fsync else ''}"
                rows[key] = timed(lambda th=th, fsync=fsync: raw_write(host, work, th, fsync))
                for f in os.listdir(work):
                    os.remove(f"{work}/{f}")
        free = shutil.disk_usage(work).free
        rounds = steady(checkpoint, state, work, args.rounds, args.gap, args.free_pinned)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = total / 1e9
    result = {"bench": "state_write", "device": device_name(dev), "date": time.strftime("%Y-%m-%d"),
              "bytes": total, "tensors": args.tensors, "vm": vm_settings(), "disk_free_bytes": free,
              "rounds_s": rounds["s"], "rounds_pinned_gb": rounds["pinned_gb"], "free_pinned": args.free_pinned,
              "gap_s": args.gap,
              "rows": {k: {"s": round(s, 3), "GB_per_s": round(gb / s, 2)} for k, s in rows.items()}}
    for k, v in result["rows"].items():
        print(f"{k:32s} {v['s']:7.2f} s {v['GB_per_s']:7.2f} GB/s", flush=True)
    print(json.dumps({k: result[k] for k in ("vm", "disk_free_bytes", "rounds_s")}))
    out = args.out or f"{HERE}/results/state_write-{result['device']}-{result['date']}.json"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
