"""Running a model's Python with its tests in a subprocess that can do little harm (POSIX only).

The program runs in `python -I -B` (no user site, no PYTHON* variables, no bytecode written), in a fresh empty
working directory, with an empty environment (the parent's secrets are not inherited), its source on stdin and its
output discarded. Before the program starts, the child lowers its own resource limits (address space, CPU seconds,
no core files, no file growth, few open files) and installs an audit hook that refuses opening files for writing,
deleting, renaming or creating files and folders, processes, signals, sockets and ctypes. The child sets its limits
itself rather than through `preexec_fn`, which is unsafe in a process with threads (a trainer, a thread pool).
This guards against accidents of generated code, not against an adversary: code can still read files and burn its
time and memory budget.
"""

import subprocess
import sys
import tempfile

TIMEOUT_S = 5.0
MAX_BYTES = 1 << 30  # address space of the child
PASSED = 75  # the child's exit status when the program ran to its end; its own exits (sys.exit(0), os._exit(0)) differ

_BLOCKED_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn",
    "os.kill", "os.killpg", "socket.__new__", "ctypes.dlopen", "os.putenv", "os.unsetenv",
    "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.link", "os.symlink", "os.truncate", "os.chmod",
    "os.chown", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree",
)

_CHILD = """
import os, resource, sys
source = sys.stdin.buffer.read().decode()
for kind, value in ((resource.RLIMIT_AS, {max_bytes}), (resource.RLIMIT_CPU, {cpu_s}), (resource.RLIMIT_CORE, 0),
                    (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(kind, (value, value))

def guard(event, args, blocked=frozenset({blocked!r}),
          writes=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
    if event in blocked or event == "open" and (isinstance(args[1], str) and set(args[1]) & set("wax+")
                                                or isinstance(args[2], int) and args[2] & writes):
        raise PermissionError(f"sandbox: {{event}} is not allowed")

sys.addaudithook(guard)
try:
    exec(compile(source, "<program>", "exec"), {{"__name__": "__program__"}})
except BaseException:
    os._exit(1)
os._exit({passed})
"""


def run_python(source: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> bool:
    """True when `source` runs to its end without an exception within `timeout_s` seconds (wall clock; CPU time is
    capped one second above it) and `max_bytes` of address space; False on any error, exit, limit or timeout.
    `if __name__ == "__main__":` blocks do not run (the program's __name__ is "__program__")."""
    child = _CHILD.format(max_bytes=max_bytes, cpu_s=int(timeout_s) + 1, blocked=_BLOCKED_EVENTS, passed=PASSED)
    with tempfile.TemporaryDirectory(prefix="sandbox-") as cwd:
        try:
            result = subprocess.run([sys.executable, "-I", "-B", "-c", child], input=source.encode(), cwd=cwd, env={},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == PASSED
