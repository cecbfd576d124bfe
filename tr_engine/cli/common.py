"""How every command-line tool ends: `sys.exit(run(main))`. Whatever goes wrong becomes one line on stderr and an
exit status, never a traceback:

    0    done (a warning, such as a matrix that could not be saved, does not change that)
    1    a bug in tr-engine, or the machine ran out of memory: the line says which
    2    a user error (a flag, a file, the input): the line names the problem and the fix
    130  Ctrl-C            143  SIGTERM

SIGTERM raises `Terminated` in the main thread, so cleanups run as they do on Ctrl-C (the chat saves its matrix).
Set TR_ENGINE_DEBUG=1 to see the traceback of a bug as well.
"""

import argparse
import os
import signal
import sys
import threading
import traceback

from tr_engine.errors import UserError, one_line

EXIT_OK, EXIT_BUG, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
DEBUG_ENV = "TR_ENGINE_DEBUG"
REPORT = (f"this is a bug in tr-engine: please report it with the traceback that {DEBUG_ENV}=1 prints "
          "(README, 'Reporting a bug')")


class Terminated(BaseException):
    """SIGTERM, as an exception: not a KeyboardInterrupt, which the chat takes as 'stop this answer' and goes on."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as one line (argparse prints its usage block and the message)."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def run(main, argv=None) -> int:
    """main(argv) -> exit status, with every way it can fail turned into one line and a status (above). A rank of a
    --tp run waits for the others at the end and exits there (tr_engine.model.parallel.leave)."""
    status = _run(main, argv)
    parallel = sys.modules.get("tr_engine.model.parallel")
    if parallel is not None and parallel.joined():
        parallel.leave()
        _exit_now(status)
    return status


def _run(main, argv=None) -> int:
    """main(argv)'s status; once main has ended, however it ended, a further Ctrl-C or SIGTERM (a second one while
    the chat saved its matrix, say) is noted instead of raised, so the exit path always ends in its one line: a
    signal that came after a clean end turns the status into its own (130, 143)."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_int = signal.getsignal(signal.SIGINT) if on_main_thread else None
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    late: list[int] = []
    try:
        status = _ended(main, argv, on_main_thread, late)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)
    if late and status == EXIT_OK:
        interrupted = late[0] == signal.SIGINT
        _say("\ninterrupted" if interrupted else "terminated")
        return EXIT_INTERRUPTED if interrupted else EXIT_TERMINATED
    return status


def _hold_signals(late: list[int]) -> None:
    """From now on, SIGINT and SIGTERM are appended to `late` instead of raised."""
    def note(signum, frame):
        late.append(signum)

    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)


def _ended(main, argv, on_main_thread: bool, late: list[int]) -> int:
    try:
        try:
            return main(argv)
        finally:
            if on_main_thread:
                _hold_signals(late)
    except UserError as e:
        _say(f"error: {e}")
        if getattr(e, "abandon_process", False):  # a --tp rank whose peers are gone: the distributed backend's
            _exit_now(EXIT_USAGE)                 # teardown could abort in its own threads; skip it
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("\ninterrupted")
        return EXIT_INTERRUPTED
    except Terminated:
        _say("terminated")
        return EXIT_TERMINATED
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say to it
        _silence_stdout()
        return EXIT_OK
    except SystemExit:
        raise
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        if _out_of_memory(e):
            _say(f"error: out of memory ({_first_line(e)}); lower --max-context, pick a smaller --dtype or model, or "
                 "free memory")
        else:
            _say(f"error: internal error ({type(e).__name__}: {_first_line(e)}); {REPORT}")
        return EXIT_BUG


def _exit_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _terminate(signum, frame):
    raise Terminated()


def _out_of_memory(e: BaseException) -> bool:
    # torch.OutOfMemoryError (a GPU) and the CPU allocator's RuntimeError, recognised without importing torch.
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = one_line(lines[0]) if lines else "no message"
    return text if len(text) <= 200 else text[:200] + "…"


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed too: the exit status is all that is left
        pass


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so Python's exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
