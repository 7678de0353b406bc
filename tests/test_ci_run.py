""".ci/run fails when a stage fails: its first stage (venv, installs, pytest) run as the script runs it, under the
script's own `set -euo pipefail`, with stand-ins on PATH for python3 (a venv whose pip fails, as a broken install
does) must stop at the failing install, before pytest and before anything after the stage."""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "run"


def _first_stage() -> tuple[str, str]:
    """(the script's `set` line, its first stage: the commands after `cd` up to the first blank line)."""
    lines = SCRIPT.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("cd ")) + 1
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip())
    return next(line for line in lines if line.startswith("set -")), "\n".join(lines[start:end])


def _executable(path: Path, text: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_broken_install_fails_the_script_before_pytest(tmp_path):
    set_line, stage = _first_stage()
    assert "pip install" in stage and "python -m pytest" in stage  # the stage is the one CI installs and tests in
    shims, venv_bin, log = tmp_path / "shims", tmp_path / "venv_bin", tmp_path / "ran.log"
    shims.mkdir(), venv_bin.mkdir()
    # python3 -m venv DIR makes DIR/bin/activate, which puts the venv's failing pip and a recording python on PATH
    _executable(shims / "python3", f'mkdir -p "$3/bin"; echo \'export PATH="{venv_bin}:$PATH"\' > "$3/bin/activate"\n')
    _executable(venv_bin / "pip", f'echo "pip $*" >> {log}; echo "ERROR: no matching distribution" >&2; exit 1\n')
    _executable(venv_bin / "python", f'echo "python $*" >> {log}\n')
    script = f"{set_line}\ncd {tmp_path}\n{stage}\necho AFTER-THE-STAGE\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
    ran = log.read_text().splitlines()
    assert out.returncode != 0 and "AFTER-THE-STAGE" not in out.stdout, (out.stdout, out.stderr)
    assert len(ran) == 1 and ran[0].startswith("pip install") and not any("pytest" in line for line in ran), ran
