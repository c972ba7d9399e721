"""One line to stderr in one write.

The launcher and its ranks share one stderr. `print` writes a line's text and its newline in
two writes, so two processes reporting at once can join their lines ("...timeout)pipedream_fast:
rank 0 ...") and a reader that looks for lines (an operator's grep, a log collector) misses
one. A line written whole, well under the pipe's atomic size, stays whole.
"""

from __future__ import annotations

import sys


def write_line(text: str) -> None:
    stream = sys.stderr
    stream.write(text + "\n")
    stream.flush()
