"""`python -m tr_engine.serve`: the serve command, tr_engine/cli/serve.py."""

import sys

from tr_engine.cli.common import run
from tr_engine.cli.serve import main

if __name__ == "__main__":
    sys.exit(run(main))
