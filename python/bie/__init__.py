"""bie from PyTorch: binary and 4-bit layers whose forward and backward run in libbie.

Pure Python over the shared library through ctypes. The library is found through the
environment variable ``BIE_LIBRARY`` (a path to ``libbie.so``), else in the repository's
build trees (when the package is used in place), else where the system loader finds an
installed ``libbie``.
"""

from . import distributed
from ._lib import BieError, library_path
from .export import export, load
from .functional import (BinaryConv2dForward, BinaryLinearForward, Q4Conv2dCutlassForward,
                         Q4LinearForward)
from .modules import (BinaryConv2dBase, BinaryConv2dCutlass, BinaryLinearBase,
                      BinaryLinearCutlass, Q4Conv2dCutlass, Q4LinearCutlass, RPReLU,
                      float_parameters, prepare_bie_layers)
from .norm import BatchNormAct, batch_norm_act
from .optim import GradScaler, SignFlip
from .runtime import (cuda_built, kernels, set_num_threads, get_num_threads, version,
                      cpu_kernel_set)

__all__ = [
    "BieError", "library_path", "distributed", "version", "cuda_built", "kernels", "cpu_kernel_set",
    "set_num_threads", "get_num_threads",
    "BinaryLinearForward", "BinaryConv2dForward", "Q4Conv2dCutlassForward", "Q4LinearForward",
    "BinaryLinearBase", "BinaryLinearCutlass", "BinaryConv2dBase", "BinaryConv2dCutlass",
    "Q4LinearCutlass", "Q4Conv2dCutlass", "prepare_bie_layers", "float_parameters", "SignFlip",
    "GradScaler",
    "RPReLU", "BatchNormAct", "batch_norm_act", "export", "load",
]
