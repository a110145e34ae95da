"""The earlier import path of :mod:`precise_bn.bn_helper` (``from precise_bn import helper``)."""
from .bn_helper import BatchNormHelper

__all__ = ["BatchNormHelper"]
