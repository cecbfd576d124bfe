"""Running the command-line tools, in a subprocess or in this process, and what their user errors must look like."""

import contextlib
import io
import subprocess
import sys
from types import SimpleNamespace

from tr_engine.cli.common import run


def run_module(module: str, *args, stdin: str | bytes | None = None, env=None, timeout: float = 600,
               **kwargs) -> subprocess.CompletedProcess:
    """`python -m module args…` in a subprocess; stdin and the output are text unless stdin is bytes."""
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True,
                          text=not isinstance(stdin, bytes), timeout=timeout, env=env, **kwargs)


def call_main(main, *args, stdin: bytes = b"") -> SimpleNamespace:
    """A tool's main() in this process, as its __main__ runs it (tr_engine.cli.common.run), with `stdin` as its input;
    returns returncode, stdout and stderr like run_module. No interpreter start (torch's import alone takes 2-3 s of
    a core here): for the many-case tests and the ones about what a command prints, not about its process. torch's
    thread count, which the tools set from --threads, is the worker's again after."""
    import torch

    out, err = io.StringIO(), io.StringIO()
    stdin_stream = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    saved, threads = sys.stdin, torch.get_num_threads()
    sys.stdin = stdin_stream
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = run(main, list(args))
    finally:
        sys.stdin = saved
        torch.set_num_threads(threads)
    return SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


def assert_one_line_error(proc, *needles):
    """Exit status 2, no traceback, one stderr line starting with "error: " that mentions every needle."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
