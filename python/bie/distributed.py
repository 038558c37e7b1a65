"""Data-parallel training of bie modules with ``torch.distributed``.

``DistributedDataParallel`` (DDP) keeps a model identical on every rank by broadcasting rank
0's parameters and buffers once, when it is built, and by averaging, in every backward, the
gradients of the floating-point parameters that require one. For bie's layers that covers
``bias_a``, ``scale_a`` and the float weights (the 4-bit layers' weights, binary weights before
``prepare_params``): they are ordinary ``nn.Parameter``s and DDP reduces them as any other.
Two things it cannot do are done here, for every bie layer whose forward runs inside a DDP
forward over a process group of more than one rank:

- **int8 binary weights.** Their gradient is the int8 quantization of the float gradient
  (SPEC §2), stored in ``weight.grad`` by the backward; DDP skips parameters that do not
  require a gradient, so each rank would flip signs after its own gradient. The backward
  instead gathers the float gradients (``BIE_PARAM_WEIGHT_FLOAT_GRAD``) into buckets, as
  DDP does with its own: a bucket's asynchronous all-reduce over DDP's process group starts
  as soon as it holds 25 MiB of gradients, so it overlaps the rest of the backward, and the
  last bucket's at the end of the backward (an autograd engine callback, run before
  ``backward()`` returns). There each bucket's sum is divided
  by the number of ranks, as DDP averages, and quantized to int8 with SPEC §1's per-tensor
  formula (:func:`quantize_int8`) into ``weight.grad``. Every rank quantizes the same reduced
  values, so every rank gets the same int8 gradient. Averaging float gradients costs one
  all-reduce of 4 bytes per weight, as an int32 sum of int8 gradients would, but an int32 sum
  needs a scale shared by all ranks first (a second collective, for the maximum) and then a
  coarser result (each rank's gradient rounded to 8 bits before the sum); the float average
  is exact up to float rounding and quantized once.
- **The first scale_a.** A layer measures ``scale_a`` (factor times mean|x|, SPEC §2/§4) on
  its first input when it is 0. Each rank has its own input, so before that forward the
  layer measures it (the C library's ``set_activation``, the formula written once), the ranks
  average their measurements (with equal batch sizes: the measurement of the whole global
  batch) and every rank stores the average. Whether scale_a is 0 is read once per C layer
  (again after ``load_state_dict``), not at every forward.

Nothing is reduced twice: bie reduces only int8 weights, which DDP leaves out; DDP reduces
the float parameters, which bie leaves alone. ``no_sync()`` is respected: no reduction in its
backwards, whose int8 weights' float gradients accumulate locally (as without DDP, see
``_layer.held_float_grad``) until the next synchronised backward reduces the sums. Every
rank must run the same bie layers in each step, as the collectives are matched by order
(DDP's ``join()`` for uneven inputs is not supported), with its bie layers on one device.

The sign-flip optimizer needs the same state on every rank: it draws its initial ``v`` from a
generator seeded with ``seed``; without one, :class:`bie.SignFlip` takes rank 0's draw on
every rank of an initialised process group (its construction is then a collective).
"""

import warnings
from typing import Any, NamedTuple

import torch

from ._layer import SCALE_A, WEIGHT, WEIGHT_FLOAT_GRAD, set_int8_grad
from ._lib import copy_all

try:
    import torch.distributed as _dist
    _AVAILABLE = _dist.is_available()
except ImportError:  # a torch built without distributed support
    _dist = None
    _AVAILABLE = False

_DDP = None
if _AVAILABLE:
    try:
        from torch.nn.parallel import DistributedDataParallel as _DDP
    except ImportError:
        _DDP = None

_MISSING = object()
_warned = False


class Sync(NamedTuple):
    """The data parallelism a bie forward runs under."""

    group: Any  # DDP's process group
    size: int  # ranks in it
    grads: bool  # its backward reduces gradients (DDP's require_backward_grad_sync)


def _warn_undetectable():
    global _warned
    if not _warned and _dist.is_initialized() and _dist.get_world_size() > 1:
        _warned = True
        warnings.warn("bie: this torch does not mark the running DistributedDataParallel "
                      "forward (DistributedDataParallel._active_ddp_module), so bie cannot "
                      "average the int8 binary weights' gradients or the first scale_a "
                      "across ranks; ranks will drift apart", RuntimeWarning, stacklevel=3)


def active():
    """The :class:`Sync` of the DistributedDataParallel forward now running, or None (no DDP
    forward running, or a process group of one rank)."""
    if _DDP is None:
        return None
    ddp = getattr(_DDP, "_active_ddp_module", _MISSING)
    if ddp is _MISSING:
        _warn_undetectable()
        return None
    if ddp is None:
        return None
    group = ddp.process_group
    size = _dist.get_world_size(group)
    if size <= 1:
        return None
    if _current is not None:
        _drop_abandoned()
    return Sync(group, size, bool(getattr(ddp, "require_backward_grad_sync", True)))


def quantize_int8(t, amax=None):
    """SPEC §1 int8 tensor quantization (narrow range, per tensor): ``amax = max|t|``,
    ``q = clamp(rint(t * 127 / amax), -127, 127)``, all zeros when ``amax == 0``; computed in
    float32 as bie's backward does (round half to even). ``amax``: the maxima if known
    (a tensor broadcasting against ``t``: several tensors quantized in one pass)."""
    t = t.to(torch.float32)
    if amax is None:
        amax = t.abs().max()
    q = torch.where(amax > 0, torch.round(t * 127.0 / amax), torch.zeros_like(t))
    return q.clamp_(-127, 127).to(torch.int8)


def agree_scale_a(layer, x, sync):
    """Before a forward of ``layer`` on input ``x`` (contiguous, the layer's float dtype) under
    ``sync``: if scale_a is 0, measure it on x, average the measurements of all ranks and store
    the average, so that the C forward finds it set. Read once per C layer (see
    ``Layer.scale_a_agreed``)."""
    if layer.scale_a_agreed or not x.is_floating_point():
        return
    scale_a = layer.view(SCALE_A)
    if float(scale_a.reshape(()).item()) == 0.0:  # the same on every rank (same parameters)
        layer.init_scale_a(x)
        total = scale_a.detach().clone()
        _dist.all_reduce(total, group=sync.group)
        scale_a.copy_(total.div_(sync.size))
    layer.scale_a_agreed = True


# The binary weights' float gradients of one backward travel in buckets, as DDP's own do: a
# bucket's all-reduce starts as soon as it holds this many bytes (DDP's default bucket size),
# the last one at the end of the backward. One collective per bucket rather than per layer,
# and one pass of the int8 quantization over each bucket, keep the host work of a step small.
BUCKET_BYTES = 25 * 2**20

_current = None  # the _Backward of the backward now running (None between backwards)


class _Backward:
    """The int8 binary weights reduced in one backward, in the order their gradients came."""

    def __init__(self):
        self.open = []  # (layer, weight, float gradient view) not yet in a bucket
        self.open_bytes = 0
        self.open_sync = None
        self.buckets = []  # (all-reduce work, flat gradients, entries, ranks)

    def add(self, layer, weight, sync, held=None):
        # The layer's memory, valid until its next backward (which replaces its gradient
        # buffers): before_backward copies it out first where that comes in this backward.
        grad = layer.view(WEIGHT_FLOAT_GRAD, grad=True)
        if held is not None:  # accumulated over backwards without zero_grad (under no_sync)
            grad = grad + held.view(grad.shape)
        if self.open and (sync.group is not self.open_sync.group
                          or grad.device != self.open[0][2].device):
            self.flush()
        self.open.append((layer, weight, grad))
        self.open_sync = sync
        self.open_bytes += grad.numel() * grad.element_size()
        if self.open_bytes >= BUCKET_BYTES:
            self.flush()

    def flush(self):
        """Copy the open gradients into one flat tensor and start its all-reduce."""
        if not self.open:
            return
        grads = [g.reshape(-1) for _, _, g in self.open]
        flat = torch.cat(grads) if len(grads) > 1 else grads[0].clone()
        work = _dist.all_reduce(flat, group=self.open_sync.group, async_op=True)
        self.buckets.append((work, flat, self.open, self.open_sync.size))
        self.open, self.open_bytes = [], 0

    def finish(self):
        """At the end of the backward: average each bucket, quantize every gradient in it, set
        ``weight.grad`` and the layers' gradients (``weight_float_grad`` and the int8 one)."""
        self.flush()
        done = []  # (layer, weight, averaged float gradient, its int8 quantization)
        for work, flat, entries, ranks in self.buckets:
            work.wait()
            flat.div_(ranks)
            pieces = flat.split([g.numel() for _, _, g in entries])
            qs = _quantize_pieces(flat, pieces).split([p.numel() for p in pieces])
            done += [(layer, weight, piece.view(grad.shape), q.view(grad.shape))
                     for (layer, weight, grad), piece, q in zip(entries, pieces, qs)]
        # A weight reduced more than once (its layer used twice in the forward): the
        # gradients add up, as torch adds a shared parameter's.
        last = {}
        for i, (layer, weight, f, _) in enumerate(done):
            j = last.get(id(weight))
            if j is not None:
                total = done[j][2] + f
                done[i], done[j] = (layer, weight, total, quantize_int8(total)), None
            last[id(weight)] = i
        dst, src = [], []
        for layer, weight, f, q in filter(None, done):
            set_int8_grad(weight, q.view(weight.shape), layer)
            if not layer.retired:  # what weight_float_grad() and the C layer report
                dst += [layer.view(WEIGHT_FLOAT_GRAD, grad=True), layer.view(WEIGHT, grad=True)]
                src += [f, q]
        copy_all(dst, src)


def _quantize_pieces(flat, pieces):
    """:func:`quantize_int8` of each of ``pieces`` (consecutive views covering the float32
    ``flat``), each with its own max|t|, in one pass over ``flat``; bit for bit the same."""
    if len(pieces) == 1:
        return quantize_int8(flat)
    norm = getattr(torch, "_foreach_norm", None)
    amax = norm(pieces, float("inf")) if norm is not None else [p.abs().max() for p in pieces]
    return quantize_int8(flat, torch.cat([m.reshape(1).expand(p.numel())
                                          for m, p in zip(amax, pieces)]))


def _finish_backward():
    global _current
    running, _current = _current, None
    if running is not None:
        running.finish()


def _drop_abandoned():
    """A DDP forward while a backward's reduction is open: that backward was abandoned (it
    raised before its end, so its end-of-backward callback never ran); its gradients are
    dropped rather than mixed into the next backward's buckets."""
    global _current
    _current = None


def before_backward(layer):
    """Before the C backward of ``layer`` (an int8 binary weight under DDP): where the
    layer's previous gradient (a layer used twice in a forward) still waits in the open
    bucket, the bucket is copied out first, since the backward replaces the layer's
    gradient buffers."""
    if _current is not None and any(entry[0] is layer for entry in _current.open):
        _current.flush()


def reduce_weight_grad(layer, weight, sync, held=None):
    """After the C backward of ``layer`` (an int8 binary weight ``weight``): add its float
    weight gradient (plus ``held``, the float gradient of earlier backwards not reset since,
    e.g. under ``no_sync()``) to the backward's buckets (whose all-reduces overlap the rest of
    the backward); at the end of the backward, set ``weight.grad`` to the int8 quantization of
    the average, and the layer's gradients (``weight_float_grad`` and the int8 one) to the
    reduced values."""
    global _current
    if _current is None:
        _current = _Backward()
    # at the end of this backward (queued by every layer: the first one's may belong to an
    # abandoned backward; the first callback to run finishes everything, the others find
    # nothing to do)
    torch.autograd.Variable._execution_engine.queue_callback(_finish_backward)
    _current.add(layer, weight, sync, held)


__all__ = ["quantize_int8", "active", "Sync"]
