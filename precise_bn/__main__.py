"""``python -m precise_bn`` and the ``precise-bn`` command.

This module imports nothing heavy itself, so that Ctrl-C while torch is still being imported
(seconds) ends the command as it does later: one line, exit status 130.
"""
from __future__ import annotations

import sys


def main() -> int:
    """Run the command line in ``sys.argv``; return the exit status."""
    try:
        from .cli import main as run

        return run()
    except KeyboardInterrupt:  # during the imports or the parsing; later ones are run's own
        print("precise-bn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
