"""bench/decode_overlap.py, smoke-tested small on CPU: the halves' draws are the whole step's."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_halves_draw_what_the_whole_step_draws(tmp_path):
    out = tmp_path / "overlap.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_overlap.py"), "--small", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["lengths"].values()
    for form in ("whole", "halves_one_stream", "halves_two_streams"):
        assert row[form]["step_ms"] > 0
        # fp32 on CPU: a half's rows take the same arithmetic as in the whole batch, so a wrong
        # half (another slot's cache, keys or length) shows as other tokens
        assert row[form]["same_tokens"] and row[form]["max_logp_diff"] < 1e-4, (form, row[form])
