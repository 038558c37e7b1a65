"""The shared library behind the package: loading, C prototypes, errors and tensor descriptors.

Everything here is private. The rest of the package talks to libbie only through
``call(function, *args)`` (which turns a failing status into :class:`BieError`) and through
descriptors made by :func:`describe` from torch tensors.
"""

import ctypes
import ctypes.util
import operator
import os
import pathlib
import threading

import torch

# ------------------------------------------------------------------ errors


class BieError(RuntimeError):
    """A call into bie failed.

    ``status`` is the numeric ``bie_status`` (see ``bie.h``), ``status_name`` its constant name
    (``"BIE_ERR_SHAPE"``) and the message is ``bie_last_error()`` of the failing call, prefixed
    with what the package was doing when it is not obvious from the message itself.
    """

    def __init__(self, status, status_name, message):
        super().__init__(f"{message} [{status_name}]")
        self.status = status
        self.status_name = status_name
        self.message = message


# Status codes the package raises itself (values of bie_status in bie.h).
ERR_INVALID_ARGUMENT = 2
ERR_SHAPE = 3
ERR_DTYPE = 4
ERR_DEVICE = 5
ERR_UNSUPPORTED = 6
ERR_STATE = 7

_STATUS_NAMES = {
    1: "BIE_ERR_NULL_POINTER", 2: "BIE_ERR_INVALID_ARGUMENT", 3: "BIE_ERR_SHAPE",
    4: "BIE_ERR_DTYPE", 5: "BIE_ERR_DEVICE", 6: "BIE_ERR_UNSUPPORTED", 7: "BIE_ERR_STATE",
    8: "BIE_ERR_OUT_OF_MEMORY", 9: "BIE_ERR_OVERFLOW", 10: "BIE_ERR_NOT_FINITE",
    11: "BIE_ERR_IO", 12: "BIE_ERR_CUDA", 13: "BIE_ERR_INTERNAL",
}


def fail(status, message):
    """Raise a BieError the package detected itself (no C call involved)."""
    raise BieError(status, _STATUS_NAMES.get(status, str(status)), message)


class BieValueError(BieError, ValueError):
    """An argument the package refuses before it reaches C (not an integer, or outside the
    range of the C parameter): both a :class:`BieError` (``BIE_ERR_INVALID_ARGUMENT``) and a
    ``ValueError``."""

    def __init__(self, message):
        super().__init__(ERR_INVALID_ARGUMENT, _STATUS_NAMES[ERR_INVALID_ARGUMENT], message)


# ------------------------------------------------------------------ integer arguments

INT_MIN, INT_MAX = -2 ** 31, 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
UINT64_MAX = 2 ** 64 - 1


def integer(value, what, low, high):
    """``value`` as a Python int within [low, high], else BieValueError.

    Every integer the package hands to C goes through here: ctypes would otherwise keep only
    the low bits of a value too large for the C type (2**32 + 8 as an ``int`` is 8). Floats are
    refused even when whole (as torch refuses ``nn.Linear(20.0, 3)``); bools, numpy and torch
    integers are accepted.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise BieValueError(f"{what} must be an integer, got a tensor {value!r}")
        value = value.item()
    try:
        number = operator.index(value)
    except TypeError:
        raise BieValueError(f"{what} must be an integer, got {value!r} "
                            f"({type(value).__name__})") from None
    if not low <= number <= high:
        raise BieValueError(f"{what} is {number}, outside the range {low}..{high} bie accepts")
    return number


def c_int(value, what, low=INT_MIN, high=INT_MAX):
    """An ``int`` argument of a C function (32 bits), range-checked."""
    return integer(value, what, max(low, INT_MIN), min(high, INT_MAX))


def c_int64(value, what, low=INT64_MIN, high=INT64_MAX):
    """An ``int64_t`` argument, range-checked."""
    return integer(value, what, max(low, INT64_MIN), min(high, INT64_MAX))


def c_uint64(value, what):
    """A ``uint64_t`` argument, range-checked."""
    return integer(value, what, 0, UINT64_MAX)


# ------------------------------------------------------------------ descriptors

MAX_DIMS = 4

F32, BF16, F16, I8, U8, U32, U64, I32 = range(8)
DEVICE_CPU, DEVICE_CUDA = 0, 1


class Device(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("index", ctypes.c_int)]


class Tensor(ctypes.Structure):
    """ctypes mirror of ``bie_tensor`` (bie.h)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("device", Device),
        ("owns_data", ctypes.c_bool),
    ]


# torch dtype -> bie dtype. Packed words of 32 and 64 bits travel in torch.int32 / torch.int64
# (torch 1.13 has no uint32 / uint64); ``describe(..., packed=True)`` selects that reading.
_TO_BIE = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16, torch.int8: I8,
           torch.uint8: U8, torch.int32: I32}
_TO_BIE_PACKED = {torch.uint8: U8, torch.int32: U32, torch.int64: U64}
_TO_TORCH = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16, I8: torch.int8,
             U8: torch.uint8, U32: torch.int32, U64: torch.int64, I32: torch.int32}
_CTYPE = {F32: ctypes.c_float, I8: ctypes.c_int8, U8: ctypes.c_uint8, U32: ctypes.c_uint32,
          U64: ctypes.c_uint64, I32: ctypes.c_int32, BF16: ctypes.c_uint16, F16: ctypes.c_uint16}

# Words of bits_binary_word bits as torch dtypes (packed inputs and qweight).
WORD_DTYPE = {8: torch.uint8, 32: torch.int32, 64: torch.int64}


def bie_device(device):
    """bie's Device for a torch.device (CUDA index resolved to the current device)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return Device(DEVICE_CPU, 0)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return Device(DEVICE_CUDA, index)
    fail(ERR_DEVICE, f"bie has no backend for torch device '{device}'")


def torch_dtype(code):
    """The torch dtype that holds elements of bie dtype ``code``."""
    return _TO_TORCH[code]


def float_dtype(dtype):
    """bie's code for a layer's float dtype (the library decides which it accepts)."""
    code = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}.get(dtype)
    if code is None:
        fail(ERR_DTYPE, f"bie layers have a float dtype (float32, bfloat16, float16), not {dtype}")
    return code


def describe(t, packed=False, what="tensor", channels_last=False, shape=None):
    """A bie_tensor describing the memory of the contiguous tensor ``t`` (no copy); with
    ``channels_last``, of the 4-D tensor ``t`` contiguous in torch.channels_last (NHWC
    memory, for a layer set to channels last; the shape stays N, C, H, W, unless ``shape``
    gives the extents in which bie reads that memory, e.g. ``[N*H*W, C, 1]``).

    The caller keeps ``t`` alive while the descriptor is in use. Tensors bie cannot describe
    (rank 0 or above 4, a dtype bie does not know, non-contiguous) raise BieError.
    """
    table = _TO_BIE_PACKED if packed else _TO_BIE
    dtype = table.get(t.dtype)
    if dtype is None:
        expected = "uint8/int32/int64 packed words" if packed else "float32"
        fail(ERR_DTYPE, f"{what} has dtype {t.dtype}; bie expects {expected}")
    ndim = t.dim()
    if ndim < 1 or ndim > MAX_DIMS:
        fail(ERR_SHAPE, f"{what} has rank {ndim}; bie tensors have rank 1..{MAX_DIMS}")
    if channels_last:
        if ndim != 4 or not t.is_contiguous(memory_format=torch.channels_last):
            fail(ERR_SHAPE, f"{what} is not a channels-last contiguous 4-D tensor")
    elif not t.is_contiguous():
        fail(ERR_SHAPE, f"{what} is not contiguous")
    shape = t.shape if shape is None else shape
    d = Tensor()
    d.data = t.data_ptr()
    d.dtype = dtype
    d.ndim = len(shape)
    for i, extent in enumerate(shape):
        d.shape[i] = extent
    if t.is_cuda:
        d.device.type = DEVICE_CUDA
        d.device.index = t.device.index
    return d


class _CudaArray:
    """Device memory owned by bie, shown to torch through ``__cuda_array_interface__``."""

    def __init__(self, ptr, shape, typestr, owner):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 2, "strides": None}
        self._owner = owner


_TYPESTR = {F32: "<f4", BF16: "<u2", F16: "<f2", I8: "|i1", U8: "|u1", U32: "<i4",
            U64: "<i8", I32: "<i4"}


def wrap(desc, owner):
    """A torch tensor over the memory a bie descriptor points at (no copy).

    ``owner`` (the layer) is referenced by the tensor's storage, so the memory outlives every
    torch tensor viewing it as long as bie does not replace the buffer itself; the modules
    detach their parameters before calls that do (see modules._sync).
    """
    shape = [desc.shape[i] for i in range(desc.ndim)]
    numel = 1
    for extent in shape:
        numel *= extent
    if desc.device.type == DEVICE_CUDA:
        array = _CudaArray(desc.data, shape, _TYPESTR[desc.dtype], owner)
        t = torch.as_tensor(array, device=torch.device("cuda", desc.device.index))
        return t.view(_TO_TORCH[desc.dtype])
    buffer = (_CTYPE[desc.dtype] * numel).from_address(desc.data)
    buffer._bie_owner = owner  # keeps the layer (and so this memory) alive
    return torch.frombuffer(buffer, dtype=_TO_TORCH[desc.dtype]).view(shape)


# ------------------------------------------------------------------ loading


def copy_all(dst, src):
    """dst[i].copy_(src[i]) for every i: one call where torch has _foreach_copy_."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None and dst:
        copy(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)


def _repo_root():
    # python/bie/_lib.py -> the repository root when used in place.
    return pathlib.Path(__file__).resolve().parents[2]


def _sanitized(build_dir):
    cache = build_dir / "CMakeCache.txt"
    try:
        return "BIE_SANITIZE:BOOL=ON" in cache.read_text(errors="replace")
    except OSError:
        return False


def _installed_prefixes():
    """Library folders where ``cmake --install`` puts libbie (default prefix /usr/local, or
    this Python's prefix), which the system loader may not search without ``ldconfig``."""
    import sys
    import sysconfig
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, "/usr/local",
                                 os.path.expanduser("~/.local"))):
        for sub in ("lib", f"lib/{multiarch}" if multiarch else None, "lib64"):
            if sub:
                dirs.append(pathlib.Path(prefix) / sub)
    return dirs


def _candidates():
    """Where libbie may be, in order: BIE_LIBRARY; the copy shipped inside the package (a
    ``pip install``); the repository's build trees (the package used in place); the system
    loader's libbie; an installed one (``cmake --install``) in the usual library folders."""
    explicit = os.environ.get("BIE_LIBRARY")
    if explicit:
        return [explicit], True
    found = []
    here = pathlib.Path(__file__).resolve().parent
    shipped = here / "libbie.so"
    if shipped.is_file():
        found.append(str(shipped))
    root = _repo_root()
    if (root / "include" / "bie.h").is_file():
        # build/ (the README's) first, then the newest other build tree. Sanitizer builds
        # cannot be loaded into an uninstrumented python.
        builds = [p for p in root.glob("build*/libbie.so") if not _sanitized(p.parent)]
        builds.sort(key=lambda p: (p.parent.name != "build", -p.stat().st_mtime))
        found += [str(p) for p in builds]
    system = ctypes.util.find_library("bie")
    if system:
        found.append(system)
    found += ["libbie.so.0", "libbie.so"]
    found += [str(d / "libbie.so") for d in _installed_prefixes() if (d / "libbie.so").exists()]
    return found, False


_lib = None
_lib_lock = threading.Lock()


def lib():
    """The loaded libbie (loaded and prototyped on first use)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            _lib = _load()
    return _lib


def library_path():
    """File name of the libbie this process uses."""
    return lib()._name


def _load():
    paths, explicit = _candidates()
    errors = []
    for path in paths:
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        _prototype(handle)
        return handle
    hint = ("BIE_LIBRARY names a library that cannot be loaded" if explicit else
            "install the package with pip (it builds and ships libbie), build it in the "
            "repository (cmake -S . -B build && cmake --build build) or set BIE_LIBRARY "
            "to the path of libbie.so")
    raise ImportError("bie: cannot load libbie: " + hint + "\n  " + "\n  ".join(errors))


_P = ctypes.c_void_p  # an opaque handle (bie_layer *)
_T = ctypes.POINTER(Tensor)
_I64 = ctypes.c_int64
_I64P = ctypes.POINTER(ctypes.c_int64)
_B = ctypes.c_bool
_I = ctypes.c_int

# bie_layer_kind (bie.h)
KIND_BINARY_LINEAR, KIND_BINARY_CONV2D, KIND_Q4_LINEAR, KIND_Q4_CONV2D = range(4)


class LayerDesc(ctypes.Structure):
    """ctypes mirror of ``bie_layer_desc`` (bie.h): what ``bie_layer_describe`` reports."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("name", ctypes.c_char_p),
        ("in_", ctypes.c_int64),
        ("out", ctypes.c_int64),
        ("fan_in", ctypes.c_int64),
        ("kernel_size", ctypes.c_int),
        ("stride", ctypes.c_int),
        ("padding", ctypes.c_int),
        ("dilation", ctypes.c_int),
        ("device", Device),
        ("dtype", ctypes.c_int),
        ("symmetric", ctypes.c_bool),
        ("training", ctypes.c_bool),
        ("kernel_id", ctypes.c_int),
        ("bits_binary_word", ctypes.c_int),
    ]


_LD = ctypes.POINTER(LayerDesc)


class BnActParams(ctypes.Structure):
    """ctypes mirror of ``bie_bn_act_params`` (bie.h): the per-channel tensors and settings of
    ``bie_bn_act_forward`` / ``bie_bn_act_backward`` (batch norm, residual add and PReLU). A
    NULL pointer (None) is an absent tensor: gamma 1, beta 0, no activation, running
    statistics not tracked."""

    _fields_ = [
        ("gamma", _T),
        ("beta", _T),
        ("slope", _T),
        ("running_mean", _T),
        ("running_var", _T),
        ("eps", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("training", ctypes.c_bool),
    ]


_BNP = ctypes.POINTER(BnActParams)

# Every C function the package calls: name -> (argtypes, restype). Status functions return int.
_PROTOTYPES = {
    "bie_status_name": ((_I,), ctypes.c_char_p),
    "bie_last_error": ((), ctypes.c_char_p),
    "bie_version_string": ((), ctypes.c_char_p),
    "bie_set_num_threads": ((_I,), _I),
    "bie_get_num_threads": ((), _I),
    "bie_cpu_kernel_set": ((), ctypes.c_char_p),
    "bie_kernel_count": ((), _I),
    "bie_kernel_get": ((_I, _P), _I),
    "bie_cuda_built": ((), _B),
    "bie_cuda_device_count": ((), _I),
    "bie_cuda_set_stream": ((_P,), _I),
    "bie_cuda_tensor_alloc": ((_T, _I, _I, _I64P, _I), _I),
    "bie_tensor_free": ((_T,), None),
    "bie_pack_signs": ((_T, _I, _T), _I),
    "bie_signflip_step": ((_T, _T, _T, _T, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                           _I64P), _I),
    # The layers' creators, one per kind:
    # (out, in, out, device, dtype[, symmetric]) for linear kinds,
    # (out, in_c, out_c, kernel_size, stride, padding, dilation, device, dtype[, symmetric]).
    "bie_binary_linear_create": ((ctypes.POINTER(_P), _I64, _I64, Device, _I, _B), _I),
    "bie_binary_conv2d_create": ((ctypes.POINTER(_P), _I64, _I64, _I, _I, _I, _I, Device, _I,
                                  _B), _I),
    "bie_q4_linear_create": ((ctypes.POINTER(_P), _I64, _I64, Device, _I), _I),
    "bie_q4_conv2d_create": ((ctypes.POINTER(_P), _I64, _I64, _I, _I, _I, _I, Device, _I), _I),
    # Every other layer call: one function for every kind.
    "bie_layer_free": ((_P,), None),
    "bie_layer_describe": ((_P, _LD), _I),
    "bie_layer_reset_parameters": ((_P, ctypes.c_uint64), _I),
    "bie_layer_set_weight_data": ((_P, _T), _I),
    "bie_layer_prepare_params": ((_P,), _I),
    "bie_layer_generate_quantized_weight": ((_P, _B), _I),
    "bie_layer_set_quantized_weight_data": ((_P, _T), _I),
    "bie_layer_set_bits_binary_word": ((_P, _I), _I),
    "bie_layer_opt_weight": ((_P, _T), _I),
    "bie_layer_param": ((_P, _I, _T), _I),
    "bie_layer_set_scale_a": ((_P, ctypes.c_float), _I),
    "bie_layer_check_forward": ((_P, _T), _I),
    "bie_layer_output_shape": ((_P, _I, _I64P, ctypes.POINTER(_I), _I64P), _I),
    "bie_layer_set_activation": ((_P, _T, _T), _I),
    "bie_layer_select_gemm_kernel": ((_P, _T), _I),
    "bie_layer_set_gemm_kernel": ((_P, _I), _I),
    "bie_layer_set_backward_mode": ((_P, _I), _I),
    "bie_layer_get_backward_mode": ((_P, ctypes.POINTER(_I)), _I),
    "bie_layer_set_channels_last": ((_P, ctypes.c_bool), _I),
    "bie_layer_get_channels_last": ((_P, ctypes.POINTER(ctypes.c_bool)), _I),
    "bie_layer_set_training": ((_P, _B), _I),
    "bie_layer_forward": ((_P, _T, _T), _I),
    "bie_layer_backward": ((_P, _T, _T), _I),
    "bie_layer_forward_again": ((_P, _T), _I),
    "bie_layer_grad": ((_P, _I, _T), _I),
    "bie_layer_set_weight_grad_target": ((_P, _T), _I),
    # batch norm, residual add and PReLU, fused:
    # forward(p, y, res, save_mean, save_rstd, out),
    # backward(p, grad_out, y, res, save_mean, save_rstd, grad_y, grad_res, grad_gamma,
    #          grad_beta, grad_slope).
    "bie_bn_act_forward": ((_BNP, _T, _T, _T, _T, _T), _I),
    "bie_bn_act_backward": ((_BNP, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T), _I),
}


def _prototype(h):
    """Give every function of _PROTOTYPES this libbie has its argument and result types
    (a function it lacks raises BieError when used; see ``function``)."""
    for name, (argtypes, restype) in _PROTOTYPES.items():
        fn = getattr(h, name, None)
        if fn is not None:
            fn.argtypes = list(argtypes)
            fn.restype = restype


def check(status, context=None):
    """Raise BieError for a failing status, with bie_last_error() of this thread."""
    if status == 0:
        return
    h = lib()
    message = h.bie_last_error().decode(errors="replace")
    name = h.bie_status_name(status).decode()
    if context:
        message = f"{context}: {message}"
    raise BieError(status, name, message)


def call(name, *args, context=None):
    """Call bie function ``name`` and check its status."""
    check(getattr(lib(), name)(*args), context)


def function(name):
    """The prototyped C function ``name``; BieError if this libbie lacks it."""
    fn = getattr(lib(), name, None)
    if fn is None:
        fail(ERR_UNSUPPORTED, f"this libbie ({library_path()}) has no function {name}")
    return fn


# ------------------------------------------------------------------ CUDA streams


# torch's current stream as a raw handle without making a Stream object (several
# microseconds a call), where this torch has the function (its C++ extensions use it).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def enter_stream(device):
    """Make bie launch on torch's current stream of ``device`` (a CUDA torch.device)."""
    if _raw_stream is not None and device.index is not None:
        handle = _raw_stream(device.index)
    else:
        handle = torch.cuda.current_stream(device).cuda_stream
    check(lib().bie_cuda_set_stream(ctypes.c_void_p(handle)))
