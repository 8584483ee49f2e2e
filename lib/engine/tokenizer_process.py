"""The tokenizer in a child process, so that importing ``transformers`` and loading it run on
another core beside a rollout process's Python-bound start-up (docs/generation.md, "Start-up").

The protocol: pickled ``(op, *args)`` requests on the child's stdin, ``(status, value)`` replies
on its stdout (its ``print``s go to stderr). It exits when its stdin closes — also when the
stage process dies.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time

_STARTED = time.time()

from llamarl.lib.errors import UserError


class TokenizerProcess:
    """The stage's side: ``load`` a checkpoint's tokenizer, then ``encode_prompts`` / ``decode``
    batches, from any thread (one request at a time)."""

    def __init__(self, proc: subprocess.Popen | None = None):
        self.proc = proc or spawn()
        self._lock = threading.Lock()
        self.eos_token_id: int | None = None
        self.times: dict = {}  # the child's start, imports done, tokenizer loaded: Unix seconds

    def _call(self, op: str, *args):
        with self._lock:
            try:
                pickle.dump((op, *args), self.proc.stdin)
                self.proc.stdin.flush()
                status, value = pickle.load(self.proc.stdout)
            except (EOFError, BrokenPipeError, OSError) as e:
                raise RuntimeError(f"the tokenizer process (python -m llamarl.lib.engine.tokenizer_process) exited "
                                   f"(status {self.proc.poll()}); its error is above") from e
        if status == "user_error":
            raise UserError(value)
        if status != "ok":
            raise RuntimeError(f"the tokenizer process: {value}")
        return value

    def load(self, checkpoint: str) -> "TokenizerProcess":
        reply = self._call("load", checkpoint)
        self.eos_token_id, self.times = reply["eos_token_id"], reply["times"]
        return self

    def encode_prompts(self, prompts: list, chat_template: str = "auto") -> list[list[int]]:
        return self._call("encode", prompts, chat_template)

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self._call("decode", ids)

    def for_thread(self) -> "TokenizerProcess":
        return self  # requests are serialised by the lock

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def spawn(checkpoint: str | None = None) -> subprocess.Popen:
    """Start the child; it imports ``transformers`` at once and, given the ``checkpoint`` it will
    be asked for, loads its tokenizer before the request comes."""
    return subprocess.Popen([sys.executable, "-m", "llamarl.lib.engine.tokenizer_process", *([checkpoint] if checkpoint else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def config_json_value(argv: list[str], key: str) -> str | None:
    """``key`` of a stage's ``--config-json`` (how every executor starts a stage), read without
    the config's imports: the checkpoint to give ``spawn``; None when not there."""
    try:
        value = json.loads(argv[argv.index("--config-json") + 1])[key]
    except (ValueError, IndexError, KeyError, TypeError):
        return None
    return value.rstrip("/") if isinstance(value, str) else None


def _serve(requests, replies, early: str | None) -> None:
    from llamarl.lib.engine import tokenizer

    def load(checkpoint: str):
        try:
            return tokenizer.Local(tokenizer.load(checkpoint)), time.time()
        except Exception as e:  # noqa: BLE001 - raised again when it is asked for
            return e, time.time()

    imported = time.time()
    loaded = {early: load(early)} if early else {}
    texts = None
    while True:
        try:
            op, *args = pickle.load(requests)
        except (EOFError, pickle.UnpicklingError):  # the stage closed its end, or died mid-request
            return
        try:
            if op == "load":
                texts, at = loaded.pop(args[0], None) or load(args[0])
                if isinstance(texts, Exception):
                    raise texts
                value = {"eos_token_id": texts.eos_token_id,
                         "times": {"started": _STARTED, "imported": imported, "loaded": at}}
            elif op == "encode":
                value = texts.encode_prompts(*args)
            elif op == "decode":
                value = texts.decode(*args)
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = ("ok", value)
        except UserError as e:
            reply = ("user_error", str(e))
        except Exception as e:  # noqa: BLE001 - sent to the stage, which raises it
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            pickle.dump(reply, replies)
            replies.flush()
        except BrokenPipeError:
            # The stage that asked is gone (it ended on an error of its own, which it reported in
            # one line): nothing is left to answer, and a traceback here would be a second error.
            os._exit(0)


if __name__ == "__main__":
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    import transformers

    transformers.PreTrainedTokenizerFast  # noqa: B018 - the lazy module's import, before any request
    _serve(requests, replies, sys.argv[1] if len(sys.argv) > 1 else None)
