"""``torch.compile`` support (torch >= 2.4): a bie module's call as one custom operator.

Under ``torch.compile`` TorchDynamo traces a model's Python code into graphs; the C calls of
bie's modules (``ctypes``) cannot be traced, so each one would split the graph. On torch 2.4
and later a bie module's forward, while it is being compiled, instead calls the operator
``torch.ops.bie.layer_call(x, params, key, training) -> (out, token)``, registered with
``torch.library.custom_op``: the compiler sees one opaque node per layer with the right output
shape and dtype (its fake implementation) and a backward (``register_autograd``) that calls
``torch.ops.bie.layer_backward``, so a model of bie and torch layers compiles to whole graphs,
forward and backward. At run time the operators run bie's ordinary eager code:

- ``layer_call`` runs the module's forward as without compilation (the autograd Function in
  training, the inference call in eval; autocast's input conversion is done before, in the
  compiled code), with autograd enabled on its own inputs, and keeps that small graph under a
  token (a CPU int64 scalar it returns) until its backward;
- ``layer_backward`` runs the kept graph's backward with the compiled backward's output
  gradient: the layer's C backward, the int8 weight gradient stored in ``weight.grad``, the
  data-parallel reduction where one applies, and returns the gradients of the input and of
  the float parameters.

So compiled and eager training compute the same values (bit for bit in the bie layers) and
share every rule of the eager path (one forward per layer before its backward, unless
``keep_inputs``; inference keeps nothing for a backward). The operator's key is the module's
``id`` (as a string): the module registers itself (weakly) when it is built or unpickled. Where the
operators do not apply — torch before 2.4, or an input of packed words — the forward runs as
without compilation and TorchDynamo splits the graph around it (a graph break).
"""

import itertools
import weakref
from typing import List, Tuple

import torch

_modules = weakref.WeakValueDictionary()  # key -> module
_runs = {}  # token -> (output, inputs needing a gradient, their positions, key), until backward
_pending = {}  # key -> tokens of the module's forwards waiting for their backward
_tokens = itertools.count(1)
_KEEP = 16  # forwards kept per keep_inputs module awaiting a backward (oldest dropped first)

_library = getattr(torch, "library", None)
AVAILABLE = _library is not None and hasattr(_library, "custom_op")
UNAVAILABLE_REASON = None if AVAILABLE else "torch.library.custom_op needs torch >= 2.4"


def register(module):
    """Make ``module`` reachable from the operators under its key (``id``); what its compiled
    forwards keep for their backward goes with it."""
    key = str(id(module))  # a string: TorchDynamo keeps it a constant (an int may turn symbolic)
    if getattr(module, "_compile_key", None) == key and _modules.get(key) is module:
        return
    module._compile_key = key
    _modules[key] = module
    weakref.finalize(module, _forget, key)


def _forget(key):
    for token in _pending.pop(key, ()):
        _runs.pop(token, None)


def compiling():
    """Whether TorchDynamo is tracing the caller now (and the operators exist)."""
    if not AVAILABLE:
        return False
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _module(key):
    module = _modules.get(key)
    if module is None:
        raise RuntimeError("bie: the module of a compiled call no longer exists")
    return module


def _out_shape(module, x):
    """The forward's output shape, from the module's sizes (symbolic sizes allowed)."""
    sizes = module._layer_args[0]
    if len(sizes) == 2:  # linear: [..., in] -> [..., out]
        return tuple(x.shape[:-1]) + (sizes[1],)
    _, out_c, k, s, p, d = sizes
    n, _, h, w = x.shape
    return (n, out_c, (h + 2 * p - d * (k - 1) - 1) // s + 1,
            (w + 2 * p - d * (k - 1) - 1) // s + 1)


def _register():
    """Define the operators (torch >= 2.4)."""

    @torch.library.custom_op("bie::layer_call", mutates_args=())
    def _layer_call(x: torch.Tensor, params: List[torch.Tensor], key: str,
                    training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        module = _module(key)
        if not training:
            with torch.no_grad():
                # contiguous, as the fake below (a channels-last result is converted)
                return (module._layer_forward(x).contiguous(),
                        torch.tensor(0, dtype=torch.int64))
        token = next(_tokens)
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(x.is_floating_point())
            out = module._layer_forward(x_in)
        want = [(i, t) for i, t in enumerate([x_in] + module._compile_params())
                if t.requires_grad]
        # A layer keeps the state of its last training forward only (unless keep_inputs): an
        # earlier forward of it that still waits for its backward could not run it anyway.
        pending = _pending.setdefault(key, [])
        while pending and (len(pending) >= _KEEP or not module.keep_inputs):
            _runs.pop(pending.pop(0), None)
        pending.append(token)
        _runs[token] = (out, [t for _, t in want], [i for i, _ in want], key)
        return out.detach().contiguous(), torch.tensor(token, dtype=torch.int64)

    @_layer_call.register_fake
    def _(x, params, key, training):
        module = _module(key)
        dtype = x.dtype if x.is_floating_point() else torch.float32
        return (x.new_empty(_out_shape(module, x), dtype=dtype),
                torch.empty((), dtype=torch.int64, device="cpu"))

    @torch.library.custom_op("bie::layer_backward", mutates_args=())
    def _layer_backward(grad_out: torch.Tensor, token: torch.Tensor, x_shape: List[int],
                        x_dtype: torch.dtype, params: List[torch.Tensor]) -> List[torch.Tensor]:
        run = _runs.pop(int(token), None)
        if run is None:
            raise RuntimeError(
                "bie: the backward of a compiled bie layer call found no forward to match: it "
                "ran in eval mode (nothing is kept for a backward), its backward ran already, "
                "or the layer ran another training forward since (create the module with "
                f"keep_inputs=True to keep up to {_KEEP})")
        out, inputs, positions, key = run
        pending = _pending.get(key)
        if pending and int(token) in pending:
            pending.remove(int(token))
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        result = ([grad_out.new_zeros(x_shape, dtype=x_dtype)] +
                  [torch.zeros_like(p) for p in params])
        for i, g in zip(positions, grads):
            if g is not None:
                result[i] = g
        return result

    @_layer_backward.register_fake
    def _(grad_out, token, x_shape, x_dtype, params):
        return ([grad_out.new_empty(x_shape, dtype=x_dtype)] +
                [torch.empty_like(p) for p in params])

    def _setup_context(ctx, inputs, output):
        x, params, _, _ = inputs
        ctx.x_shape, ctx.x_dtype = list(x.shape), x.dtype
        ctx.save_for_backward(output[1], *params)

    def _backward(ctx, grad_out, _grad_token):
        token, *params = ctx.saved_tensors
        grads = torch.ops.bie.layer_backward(grad_out.contiguous(), token, ctx.x_shape,
                                             ctx.x_dtype, params)
        return grads[0], list(grads[1:]), None, None

    _layer_call.register_autograd(_backward, setup_context=_setup_context)


if AVAILABLE:
    try:
        _register()
    except Exception as error:  # an API this torch lacks: compile with graph breaks instead
        AVAILABLE = False
        UNAVAILABLE_REASON = f"registering bie's operators failed: {error!r}"


def forward(module, x):
    """The module's forward while being compiled: the operator (see the module docstring)."""
    out, _ = torch.ops.bie.layer_call(x, module._compile_params(), module._compile_key,
                                      module.training)
    return out


__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "compiling", "forward", "register"]
