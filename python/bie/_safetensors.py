"""safetensors files as ``bie``'s writer lays them out (tools/bie/model_io.h), read and written
with the standard library and torch: :func:`write_safetensors`, :func:`read_safetensors` (used
by :mod:`bie.export`, which re-exports both)."""

import ctypes
import json
import math
import os
import sys

import torch

from . import _lib
from ._lib import fail

_ERR_IO = 11  # BIE_ERR_IO

# safetensors dtype -> (torch dtype holding the same bytes, element size)
_ST_DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8), "F16": (torch.float16, 2),
              "BF16": (torch.bfloat16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
              "I16": (torch.int16, 2), "I32": (torch.int32, 4), "U32": (torch.int32, 4),
              "I64": (torch.int64, 8), "U64": (torch.int64, 8)}


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def write_safetensors(path, tensors, metadata):
    """Write ``tensors`` (a list of (name, safetensors dtype, tensor)) and ``metadata`` (str ->
    str) as ``bie``'s writer does: tensors with larger elements first (then in the given
    order), the compact JSON header padded with spaces to a multiple of 8 bytes, written to
    ``path.partial`` and renamed into place."""
    if sys.byteorder != "little":
        fail(_lib.ERR_UNSUPPORTED, "bie.export: safetensors files are little-endian; this "
             "host is not")
    order = sorted(range(len(tensors)), key=lambda i: (-_ST_DTYPES[tensors[i][1]][1], i))
    header = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, offset = [], 0
    for i in order:
        name, dtype, t = tensors[i]
        data = _tensor_bytes(t)
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    partial = os.fspath(path) + ".partial"
    try:
        with open(partial, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for data in blobs:
                f.write(data)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def read_safetensors(path):
    """(tensors: name -> (safetensors dtype, torch tensor), metadata: dict) of a file; U32 /
    U64 tensors come as int32 / int64 tensors holding the same bytes."""
    with open(path, "rb") as f:
        data = f.read()
    where, n = os.fspath(path), int.from_bytes(data[:8], "little")
    try:
        if len(data) < 8 or not 2 <= n <= len(data) - 8:
            raise ValueError(f"a header of {n} bytes in a file of {len(data)} (truncated?)")
        header = json.loads(data[8:8 + n].decode())
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError too
        fail(_ERR_IO, f"{where}: not a safetensors file: {e}")
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            torch_dtype, size = _ST_DTYPES[dtype]
        except (KeyError, TypeError, ValueError):
            fail(_ERR_IO, f"{where}: tensor '{name}': bad entry or unsupported dtype {entry!r}")
        numel = math.prod(shape)
        if not 0 <= begin <= end <= len(body) or end - begin != numel * size:
            fail(_ERR_IO, f"{where}: tensor '{name}': data_offsets {[begin, end]} do not fit "
                 f"{dtype} {shape} in {len(body)} bytes of data")
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=torch_dtype) if numel else \
            torch.empty(0, dtype=torch_dtype)
        tensors[name] = (dtype, t.reshape(shape))
    return tensors, metadata


__all__ = ["read_safetensors", "write_safetensors"]
