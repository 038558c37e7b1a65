"""Library-wide information and settings: version, kernels, threads, CUDA availability."""

import ctypes

from . import _lib


class _KernelInfo(ctypes.Structure):
    """ctypes mirror of ``bie_kernel_info`` (bie.h)."""

    _fields_ = [("id", ctypes.c_int), ("name", ctypes.c_char_p), ("isa", ctypes.c_char_p),
                ("op", ctypes.c_int), ("device", ctypes.c_int),
                ("preferred_max_m", ctypes.c_int64), ("available", ctypes.c_bool)]


_OPS = {0: "binary_gemm", 1: "q4_gemm"}


def version():
    """libbie's version, "major.minor.patch"."""
    return _lib.lib().bie_version_string().decode()


def cuda_built():
    """True when libbie was built with its CUDA backend."""
    return bool(_lib.lib().bie_cuda_built())


def cpu_kernel_set():
    """The CPU kernel set in use ("scalar", "generic", "avx2", "avx512"); the environment
    variable BIE_CPU_KERNELS caps it."""
    return _lib.lib().bie_cpu_kernel_set().decode()


def kernels():
    """Every registered GEMM kernel as a dict: id (for gemm_kernel_id), name, isa, op
    ("binary_gemm" / "q4_gemm"), device ("cpu" / "cuda"), available."""
    h = _lib.lib()
    result = []
    for i in range(h.bie_kernel_count()):
        info = _KernelInfo()
        _lib.check(h.bie_kernel_get(i, ctypes.byref(info)))
        result.append({"id": info.id, "name": info.name.decode(), "isa": info.isa.decode(),
                       "op": _OPS.get(info.op, str(info.op)),
                       "device": "cuda" if info.device == _lib.DEVICE_CUDA else "cpu",
                       "available": bool(info.available)})
    return result


def set_num_threads(n):
    """Threads for bie's CPU kernels and OpenBLAS (0 = the default)."""
    _lib.check(_lib.lib().bie_set_num_threads(_lib.c_int(n, "threads")))


def get_num_threads():
    return _lib.lib().bie_get_num_threads()
