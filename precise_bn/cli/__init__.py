"""The ``precise-bn`` command: recalibrate, inspect and convert saved checkpoints.

    precise-bn recompute ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/train
    precise-bn inspect ckpt.pt --against ckpt.precise_bn.pt
    precise-bn convert model_final.pkl model_final.pt
    precise-bn demo

Exit status: 0 on success, 2 on a usage error, 1 on a failure, shown as one line that names the
file, key, layer or argument at fault (``--debug`` adds the traceback); 130 after Ctrl-C, 143
after SIGTERM. Under ``torchrun`` every rank measures its shard, the stats are merged exactly,
and rank 0 alone writes.

Ctrl-C while the package is still being imported (torch takes seconds) ends the command the
same way as later: one line, exit status 130.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

INTERRUPTED = "precise-bn: interrupted"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        from .command import main as run

        return run(argv)
    except KeyboardInterrupt:  # during the imports or the parsing; later ones are run's
        print(INTERRUPTED, file=sys.stderr)
        return 130
