#!/usr/bin/env python
"""The ``precise-bn`` command as a standalone script, for a checkout without installing the package.

    python scripts/recompute_precise_bn.py recompute ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/train
    python scripts/recompute_precise_bn.py inspect ckpt.pt --against ckpt.precise_bn.pt

Takes exactly the sub-commands and arguments of ``precise-bn`` (``--help`` lists them).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from precise_bn.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
