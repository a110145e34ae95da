"""``python -m precise_bn`` and ``precise-bn``: Ctrl-C while torch is imported ends it as later."""
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
