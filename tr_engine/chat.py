"""`python -m tr_engine.chat`: the chat command, tr_engine/cli/chat.py."""

import sys

from tr_engine.cli.chat import main
from tr_engine.cli.common import run

if __name__ == "__main__":
    sys.exit(run(main))
