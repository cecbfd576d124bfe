"""A one-line progress meter on stderr for the weight tools (no dependency, silent when not a terminal)."""

import sys
import time


def progress(items, total: int, desc: str):
    """Yield from `items`, redrawing `desc: i/total` on stderr at most ten times a second."""
    shown = sys.stderr.isatty()
    last = 0.0
    for i, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if shown and (now - last > 0.1 or i == total):
            sys.stderr.write(f"\r{desc}: {i}/{total}")
            sys.stderr.flush()
            last = now
    if shown:
        sys.stderr.write("\n")
