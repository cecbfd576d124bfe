"""`python -m tr_engine.generate`: the generate command, tr_engine/cli/generate.py."""

import sys

from tr_engine.cli.common import run
from tr_engine.cli.generate import main

if __name__ == "__main__":
    sys.exit(run(main))
