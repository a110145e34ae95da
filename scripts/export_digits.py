"""Writes ``precise_bn/digits.npz``, the demo's data, from scikit-learn's copy of the digits.

    python scripts/export_digits.py        (needs scikit-learn; the package itself never does)

The data: the 1797 8x8 handwritten digits of the UCI "Optical Recognition of Handwritten Digits"
test set (E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), pixel values 0-16, as scikit-learn bundles
them. A stratified quarter is held out (scikit-learn's ``train_test_split``, ``random_state=0``),
and both parts are stored in the order that split gives, as uint8, so that the demo, the tests and
the benchmarks see the same tensors they saw when they read scikit-learn directly.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

TARGET = Path(__file__).resolve().parents[1] / "precise_bn" / "digits.npz"


def digits_arrays() -> dict:
    """The four uint8 arrays the file holds, computed from scikit-learn's digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    train, test = train_test_split(np.arange(len(digits.target)), test_size=0.25, stratify=digits.target,
                                   random_state=0)
    images, labels = digits.images.astype(np.uint8), digits.target.astype(np.uint8)
    return {"train_images": images[train], "train_labels": labels[train],
            "test_images": images[test], "test_labels": labels[test]}


def main() -> None:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **digits_arrays())
    TARGET.write_bytes(buffer.getvalue())
    print("wrote {} ({} bytes)".format(TARGET, len(buffer.getvalue())))


if __name__ == "__main__":
    main()
