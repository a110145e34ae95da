#!/usr/bin/env python
"""Recalibrate a checkpoint's BatchNorm stats: ``precise-bn recompute`` as a standalone script.

    python scripts/recompute_precise_bn.py ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/train

Takes exactly the arguments of ``precise-bn recompute`` (``--help`` lists them). Runs from a
checkout without installing the package.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from precise_bn.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["recompute"] + sys.argv[1:]))
