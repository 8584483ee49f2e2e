"""The suite's own scheduling (tests/conftest.py): under ``make test``'s two workers a file's tests
run on one worker, in order, and the Slurm files share one — tests of a file build on each other's
outputs, and two Slurm clusters on one host end each other's steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys

_CONFTEST = """
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {path!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
pytest_collection_modifyitems = ours.pytest_collection_modifyitems
pytest_xdist_make_scheduler = ours.pytest_xdist_make_scheduler
"""

_FILE = """
import os
def _log(request):
    with open({log!r}, "a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{request.node.nodeid}}\\n")
""" + "".join(f"def test_{i}(request):\n    _log(request)\n" for i in range(6))


def test_make_tests_workers_take_a_file_whole_in_order_and_the_slurm_files_together(tmp_path):
    log = tmp_path / "ran.txt"
    conftest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(_CONFTEST.format(path=conftest))
    files = ("test_slurm.py", "test_multihost.py", "test_one.py", "test_two.py", "test_three.py")
    for name in files:
        (suite / name).write_text(_FILE.format(log=str(log)))
    (suite / "pytest.ini").write_text("[pytest]\n")
    root = os.path.dirname(os.path.dirname(conftest))
    flags = re.search(r"-m pytest (.*) tests;", open(os.path.join(root, "Makefile")).read()).group(1).split()
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *flags, "."], cwd=suite,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ran = [line.split() for line in log.read_text().splitlines()]
    by_file: dict[str, list[tuple[str, str]]] = {}
    for worker, nodeid in ran:
        by_file.setdefault(nodeid.split("::")[0], []).append((worker, nodeid.split("::")[1]))
    assert sorted(by_file) == sorted(files)
    for name, tests in by_file.items():
        assert len({w for w, _ in tests}) == 1, (name, tests)
        assert [t for _, t in tests] == [f"test_{i}" for i in range(6)], (name, tests)
    assert by_file["test_slurm.py"][0][0] == by_file["test_multihost.py"][0][0]
    assert len({tests[0][0] for tests in by_file.values()}) == 2  # and both workers worked
