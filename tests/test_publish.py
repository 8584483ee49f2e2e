"""Manifest checksums: the fast one written now (hashed while writing), sha256 of older outputs
still verified."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import torch
import xxhash

from llamarl.lib.files import checksums, publish


def _xxh3(path) -> str:
    return xxhash.xxh3_128(open(path, "rb").read()).hexdigest()


def test_checksums_written_and_verified_old_sha256_still_read(tmp_path):
    f = tmp_path / "part.bin"
    f.write_bytes(b"llamarl" * 1000)
    entry = publish.file_entry(str(f))
    assert set(entry) == {"bytes", "xxh3_128"}
    old = {"bytes": entry["bytes"], "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    publish.verify(str(tmp_path), {"part.bin": entry})
    publish.verify(str(tmp_path), {"part.bin": old})
    f.write_bytes(b"llamarL" + b"llamarl" * 999)  # same size, one byte changed
    for e, name in ((entry, "xxh3_128"), (old, "sha256")):
        with pytest.raises(publish.PublishError, match=f"does not match its {name} checksum"):
            publish.verify(str(tmp_path), {"part.bin": e})


def test_old_format_sha256_manifest_verifies_and_a_flipped_byte_is_caught(tmp_path):
    # A directory published before xxh3: its manifest names sha256 for every file.
    root = tmp_path / "old"
    (root / "parts").mkdir(parents=True)
    files = {}
    for i in range(3):
        data = os.urandom(5000 + i)
        (root / "parts" / f"part-{i:06d}.parquet").write_bytes(data)
        files[f"parts/part-{i:06d}.parquet"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format_version": 1, "kind": "rollout", "created": "2026-11-01T00:00:00Z", "files": files}
    (root / publish.MANIFEST).write_text(json.dumps(manifest))
    assert publish.require_verified(str(root), "rollout", "parts/")["files"] == files
    part = root / "parts" / "part-000001.parquet"
    data = bytearray(part.read_bytes())
    data[1234] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(publish.PublishError, match="part-000001.parquet does not match its sha256 checksum"):
        publish.require_verified(str(root), "rollout", "parts/")


def test_unknown_algorithm_is_one_clear_line(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(publish.PublishError, match="names no checksum this version knows"):
        publish.verify(str(tmp_path), {"f": {"bytes": 1, "blake3": "00"}})


def test_written_checksum_equals_a_separate_hash_of_the_file(tmp_path):
    # Every writer that hashes on the way: open_write, write_bytes, the safetensors writer, DCP.
    from llamarl.lib.files import checkpoint
    from llamarl.lib.files.safetensors_io import write_file

    with publish.open_write(str(tmp_path / "a" / "stream.bin")) as f:
        for i in range(50):
            f.write(os.urandom(1000 + i))
    entries = {"a/stream.bin": f.entry(),
               "bytes.json": publish.write_bytes(str(tmp_path / "bytes.json"), b'{"x": 1}'),
               "w.safetensors": write_file(str(tmp_path / "w.safetensors"),
                                           {"w": torch.randn(64, 33).to(torch.bfloat16), "b": torch.arange(5)})}
    checkpoint.save({"t": torch.randn(100, 7), "u": torch.randn(3).to(torch.bfloat16)}, str(tmp_path / "model"), threads=2)
    for name in sorted(os.listdir(tmp_path / "model")):
        entries[f"model/{name}"] = publish.written_entry(str(tmp_path / "model" / name))
    assert "model/.metadata" in entries and "model/__0_1.distcp" in entries
    for name, entry in entries.items():
        path = tmp_path / name
        assert entry == {"bytes": path.stat().st_size, "xxh3_128": _xxh3(path)}, name
        assert publish.file_entry(str(path)) == entry  # what a manifest gets, without a second read
    publish.verify(str(tmp_path), entries)


def test_a_file_changed_after_writing_is_hashed_again(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    entry = publish.write_bytes(str(path), b"a" * 100)
    reads = []
    real = publish.checksum
    monkeypatch.setattr(publish, "checksum", lambda url, *a, **k: reads.append(url) or real(url, *a, **k))
    assert publish.file_entry(str(path)) == entry and reads == []  # hashed while written: no read
    time.sleep(0.02)
    path.write_bytes(b"b" * 100)  # same size, rewritten behind the writer's back
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # however coarse the clock
    assert publish.file_entry(str(path)) == {"bytes": 100, "xxh3_128": _xxh3(path)} and reads == [str(path)]
    path.write_bytes(b"c" * 10)
    assert publish.file_entry(str(path))["bytes"] == 10


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with publish.open_write(str(tmp_path / "f.bin")) as f:
            f.write(b"half")
            raise RuntimeError("disk full")
    assert not (tmp_path / "f.bin").exists() and publish.written_entry(str(tmp_path / "f.bin")) is None


def test_verification_shares_are_balanced_by_bytes():
    files = {f"model/__{i}_0.distcp": {"bytes": 1000} for i in range(4)} | {f"hf/{n}": {"bytes": 10} for n in "abcd"}
    shares = [publish.share(files, sorted(files), r, 4) for r in range(4)]
    assert sorted(n for s in shares for n in s) == sorted(files)
    assert all(sum(n.startswith("model/") for n in s) == 1 for s in shares)


def test_memory_filesystem_writes_are_hashed_too():
    url = "memory://llamarl-test-publish/x.bin"
    entry = publish.write_bytes(url, b"z" * 4097)
    assert entry == {"bytes": 4097, "xxh3_128": xxhash.xxh3_128(b"z" * 4097).hexdigest()}
    assert publish.file_entry(url) == entry == {"bytes": 4097, "xxh3_128": publish.checksum(url)}


def test_tree_checksum_is_the_digest_of_its_blocks_digests(tmp_path, monkeypatch):
    import xxhash

    monkeypatch.setattr(checksums, "TREE_BLOCK", 10000)
    monkeypatch.setattr(checksums, "_BLOCK", 4096)  # mapped a window at a time: several a block
    data = os.urandom(35000)
    (tmp_path / "f").write_bytes(data)
    blocks = [xxhash.xxh3_128(data[i : i + 10000]).digest() for i in range(0, 35000, 10000)]
    want = xxhash.xxh3_128(b"".join(blocks)).hexdigest()
    assert checksums._tree_checksum(str(tmp_path / "f"), threads=3, read_bytes=300) == want  # mapped
    publish.write_bytes("memory://llamarl-test-tree/f", data)
    assert checksums._tree_checksum("memory://llamarl-test-tree/f", threads=3, read_bytes=300) == want  # read
    # A caching wrapper's paths are not this machine's (fsspec's local_file says they are).
    assert checksums._tree_checksum("simplecache::memory://llamarl-test-tree/f", threads=1) == want
    assert checksums.checksum("simplecache::memory://llamarl-test-tree/f") == xxhash.xxh3_128(data).hexdigest()
    assert checksums.checksum(str(tmp_path / "f")) == xxhash.xxh3_128(data).hexdigest()  # mapped, in windows
    entry = publish.file_entry(str(tmp_path / "f"), publish.TREE)
    assert entry == {"bytes": 35000, publish.TREE: want}
    publish.verify(str(tmp_path), {"f": entry})  # verifies as any other entry
    (tmp_path / "f").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(publish.PublishError, match="does not match its xxh3_128_tree checksum"):
        publish.verify(str(tmp_path), {"f": {**entry, "bytes": 35000}})
