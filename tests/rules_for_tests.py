"""Reward rules used by the tests through the module:function path."""


def nan_rule(response: str, row: dict) -> float:
    return float("nan")


def response_length(response: str, row: dict) -> float:
    return float(len(row["response_token_ids"]))


def raises(response: str, row: dict) -> float:
    raise ValueError("no")


def returns_none(response: str, row: dict):
    return None


def reads_absent_column(response: str, row: dict) -> float:
    return float(row["nope"])


def huge(response: str, row: dict) -> float:
    """±1e30: finite, and far beyond what ppo's float32 arithmetic survives."""
    return 1e30 if row["sample_index"] % 2 else -1e30


def huge_int(response: str, row: dict) -> int:
    """An int beyond any float."""
    return 10**400


_SANDBOX = None


def sandboxed(response: str, row: dict) -> float:
    """As a rule that runs code from the response in a sandbox process would. With
    LLAMARL_TEST_SANDBOX set, its sandbox hangs (it outlives the rule) and every row takes a while."""
    import os
    import subprocess
    import sys
    import time

    global _SANDBOX
    if os.environ.get("LLAMARL_TEST_SANDBOX"):
        if _SANDBOX is None:
            _SANDBOX = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(0.2)
    return float(len(response) % 2)


def killed_once(response: str, row: dict) -> float:
    """The response's length; but the first time it runs (the file $LLAMARL_TEST_KILL_ONCE not there
    yet) its process is killed outright: SIGKILL, as a host's OOM killer or a lost node would."""
    import os
    import signal

    marker = os.environ.get("LLAMARL_TEST_KILL_ONCE")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return float(len(response))
