"""The sandbox runs code to its end or reports failure, and the code cannot reach the parent's environment, write or
delete files, start processes or escape its limits."""

import time

from trainers.python_sandbox import run_python


def test_a_program_that_runs_to_its_end_passes_and_one_that_raises_or_exits_does_not():
    assert run_python("import math\nassert math.gcd(4, 6) == 2\n")
    assert not run_python("assert 1 == 2\n")
    assert not run_python("import sys\nsys.exit(0)\n")  # its own exits are not success
    assert not run_python("import os\nos._exit(0)\n")
    assert run_python("if __name__ == '__main__':\n    raise SystemExit(1)\n")  # main blocks do not run


def test_a_program_that_runs_too_long_or_too_big_fails_in_time():
    start = time.perf_counter()
    assert not run_python("while True:\n    pass\n", timeout_s=1.0)
    assert time.perf_counter() - start < 3.0
    assert not run_python("x = bytearray(4 << 30)\n")  # beyond the address-space limit


def test_the_parents_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SPEC_ROLLOUTS_TEST_SECRET", "token")
    assert run_python("import os\nassert 'SPEC_ROLLOUTS_TEST_SECRET' not in os.environ\n")


def test_files_outside_are_neither_written_nor_deleted(tmp_path):
    outside, kept = tmp_path / "written.txt", tmp_path / "kept.txt"
    kept.write_text("kept")
    attempts = [f"open({str(outside)!r}, 'w').write('x')", f"import os\nos.remove({str(kept)!r})",
                f"import shutil\nshutil.rmtree({str(tmp_path)!r})", "open('local.txt', 'w').write('x')"]
    for source in attempts:
        assert not run_python(source), source
    assert not outside.exists() and kept.read_text() == "kept"


def test_processes_sockets_and_ctypes_are_refused():
    for source in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')",
                   "import socket\nsocket.socket()", "import ctypes"):
        assert not run_python(source), source
