"""Manifest checksums: the fast one written now, sha256 of older outputs still verified."""

from __future__ import annotations

import hashlib

import pytest

from llamarl.lib import publish


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
