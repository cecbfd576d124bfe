"""Saving state files (the recycling matrix, the cost curve) so that no reader, crash or second writer ever sees half
of one.

`atomic_write` writes the bytes into a temporary file beside the target, unique to the writer (host, pid and a random
part in its name), syncs it and renames it over the target: readers see the old file or the new one, never a mix.
Any failure (a full disk, a read-only folder) removes the temporary file and keeps the old target. Ctrl-C and
SIGTERM wait until the rename is done (a save takes well under a second) and then act as usual. A writer killed
outright (SIGKILL, a power cut) leaves its temporary file behind; the next save to the same target removes it once
its writer is gone.

Two processes saving the same target: the last rename wins, and each file on disk is always one writer's whole
state. No lock: the contents are caches that only speed decoding up, any one writer's is a good state, and a merge
would need per-row timestamps; a lock would order the writes without changing that outcome, and would add a
failure mode of its own (a lock left by a killed writer).
"""

import contextlib
import os
import secrets
import signal
import socket
import threading
from pathlib import Path

TMP_SUFFIX = ".tmp"


def atomic_write(path: str | Path, data: bytes) -> None:
    """Put `data` at `path` atomically. Raises OSError (the old file kept, no temporary file left) when the folder or
    the disk refuses: a read-only or missing folder, a path that is a folder, a full disk."""
    path = Path(path)
    if path.parent.exists() and not path.parent.is_dir():
        raise NotADirectoryError(20, "its parent is a file, not a folder", str(path.parent))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(21, "it is a folder", str(path))
    remove_stale_temporaries(path)
    tmp = path.with_name(f"{path.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    with signals_deferred():
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename, so a power cut cannot leave an empty target
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def load_state(path: str | Path, error: type[Exception], what: str, flag: str):
    """A state file this package saved (torch.save of tensors and plain values), read with weights_only, so no pickled
    code runs; every way the read can fail is one line of `error`: no file, a folder, unreadable, not such a file at
    all. `what` names it ("recycling matrix"), `flag` the option that points at it ("--matrix"). Its contents are the
    caller's to check."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch warns about garbage that looks like a pickle: one line is ours
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise error(f"no {what} at {path}; drop {flag} to start from an empty one") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a {what} file; pass a file path to {flag}") from None
    except PermissionError:
        raise error(f"{path} cannot be read (permission denied); fix its permissions or pass another {flag} file"
                    ) from None
    except Exception as e:  # corrupt or foreign file: torch raises several types
        raise error(f"{path} is not a {what} file ({type(e).__name__}); delete it to start fresh") from None


def temporaries(path: Path) -> list[Path]:
    """The temporary files of saves to `path` that are in progress or were cut short."""
    return sorted(path.parent.glob(f"{glob_escape(path.name)}.*{TMP_SUFFIX}"))


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files that writers on this host left behind when they were killed mid-save."""
    for tmp in temporaries(path):
        parts = tmp.name[len(path.name) + 1 :].split(".")
        if len(parts) == 4 and parts[0] == _host() and parts[1].isdigit() and not _alive(int(parts[1])):
            with contextlib.suppress(OSError):
                tmp.unlink()


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM until the block ends, then deliver them to the handlers that were in place. (Signal
    handlers belong to the main thread; elsewhere this does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(s)
        if handler is None:  # installed outside Python: leave it alone
            continue
        previous[s] = handler
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _host() -> str:
    return "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:32] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: someone else's live process
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
