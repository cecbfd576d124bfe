"""Running the command-line tools in a subprocess, and what their user errors must look like."""

import subprocess
import sys


def run_module(module: str, *args, stdin: str | None = None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          timeout=600, env=env)


def assert_one_line_error(proc, *needles):
    """Exit status 2, no traceback, one stderr line starting with "error: " that mentions every needle."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
