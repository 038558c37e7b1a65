"""The sign-flip optimizer for int8 binary weights, with Adam(W) for float parameters (SPEC §5)."""

import math

import torch

from ._lib import copy_all

_FLAT_DEVICE_TYPES = ("cuda",)  # devices whose binary step runs on flat tensors (see _flip)


def _same_on_every_rank(seed):
    """Rank 0's seed on every rank of an initialised torch.distributed group (a collective:
    every rank constructs its optimizer); the seed itself elsewhere."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return seed
    t = torch.tensor([seed], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.broadcast(t, src=0)
    return int(t.item())


class SignFlip(torch.optim.Optimizer):
    """Sign flips for int8 binary weights, Adam / AdamW for float parameters (SPEC §5).

    For an int8 parameter (a prepared binary weight) with gradient ``g`` (its int8-quantized
    gradient, which bie's backward stores in ``weight.grad``), element by element::

        m = lerp(m, g, 1 - beta1);  v = lerp(v, sgn0(m) * lr, 1 - beta2);  u = -sign(v)
        where u != sign(w): w = -w

    where ``sgn0(0) = 0`` (the momentum's sign only) and ``sign(0) = +1`` everywhere else; a
    zero weight becomes -1 when it flips. The state starts at ``m = 0``,
    ``v = -sign(w) * delta`` with ``delta`` uniform in (0, 1e-3], drawn once per element (at
    the parameter's first step, in parameter order) from the optimizer's generator, seeded
    with ``seed`` or, when ``seed`` is None, with a number drawn from torch's default
    generator at construction (so ``torch.manual_seed`` decides it; under an initialised
    ``torch.distributed`` group, rank 0's draw, broadcast, so that every rank of a
    data-parallel run starts from the same state). So ``u`` starts equal to
    ``sign(w)``: a weight whose gradient has been 0 since the start never flips.

    Float parameters (scale_a, bias_a, float weights, the rest of the network) take an Adam
    step with bias correction, ``float_lr`` / ``float_betas`` / ``eps``; ``weight_decay`` is
    decoupled (AdamW) when ``decoupled_weight_decay`` is true, else added to the gradient.
    Both rates are read from the parameter group at every step: torch's learning-rate
    schedulers change ``lr`` (the sign flips'); to schedule ``float_lr`` too, set
    ``group["float_lr"]`` (e.g. scaled as ``lr`` is) before each step.
    Runs on whatever device the parameters are on, with torch operations. A step is one
    pass over all parameters (grouped by parameter group and device): on CUDA the binary
    weights' update runs on flat tensors over all of them (their ``m`` and ``v`` states are
    pieces of one flat tensor each, made again when the set of parameters with a gradient
    changes or ``load_state_dict`` replaced them; the weights and gradients are gathered
    with one ``cat`` each and the new weights copied back), a dozen operations whatever the
    number of layers; on the CPU tensor by tensor. The float parameters' Adam runs as
    ``torch._foreach_*`` operations over the lists of parameters, gradients and states (an
    operation this torch lacks, e.g. ``_foreach_lerp_`` before torch 2.0, runs tensor by
    tensor with the same arithmetic). ``foreach=False`` runs the same arithmetic tensor by
    tensor; all forms give bit-identical results. A step never synchronises with the device:
    the number of binary weights that changed sign in the last step stays on the device and
    is read only when ``flipped`` is asked for.

    ``capturable=True`` (as torch's Adam has it) keeps the Adam step counts as float32
    tensors on the parameters' devices and computes the bias corrections there, so that a
    step can be captured in a CUDA graph and replayed (the default computes them on the host
    from Python step counts, which a graph would freeze). The binary step needs nothing of
    the kind. With foreach on a GPU the capturable Adam also runs on flat tensors (each
    parameter's bias corrections spread over its elements): a fixed number of operations
    for any number of float parameters. The float parameters then differ from the default
    mode's in the last bits (float32 bias corrections), as in torch; the first step (it
    draws the sign-flip state) must run before a capture.

    ``scale_a_floor=f`` (a fraction in (0, 1]; off by default, as SPEC §5 has none) keeps
    each bie layer's ``scale_a`` at or above ``f`` times the value its first step left it
    with, a projection after each step (``bie train`` does the same with 0.5). Adam moves a
    parameter by about ``float_lr`` a step whatever its gradient's size, so an activation
    scale of a few tenths can be driven through zero within a few epochs; the layer's
    straight-through window then closes and training collapses.
    """

    def __init__(self, params, lr=1e-4, betas=(0.99, 0.9999), float_lr=1e-3,
                 float_betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=True, seed=None, foreach=True, capturable=False,
                 scale_a_floor=None):
        for name, value in (("lr", lr), ("float_lr", float_lr), ("eps", eps)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"SignFlip: {name} must be finite and > 0, got {value}")
        for name, pair in (("betas", betas), ("float_betas", float_betas)):
            if len(pair) != 2 or not all(0.0 <= b < 1.0 for b in pair):
                raise ValueError(f"SignFlip: {name} must be two values in [0, 1), got {pair}")
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(f"SignFlip: weight_decay must be finite and >= 0, got {weight_decay}")
        if scale_a_floor is not None and not 0.0 < scale_a_floor <= 1.0:
            raise ValueError(f"SignFlip: scale_a_floor must be None or in (0, 1], got "
                             f"{scale_a_floor}")
        defaults = dict(lr=lr, betas=tuple(betas), float_lr=float_lr,
                        float_betas=tuple(float_betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay,
                        capturable=bool(capturable), scale_a_floor=scale_a_floor)
        super().__init__(params, defaults)
        if seed is None:
            seed = _same_on_every_rank(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
        self._generator = torch.Generator().manual_seed(int(seed))
        self.foreach = bool(foreach)
        self._flip_counts = []  # the last step's flip counts, one int64 tensor per device
        self._flat = {}  # (dtype, parameter ids) -> flat m and v (_flat_states)
        self._spread = {}  # (device, sizes) -> the sizes as a device tensor (_adam_flat)

    @property
    def flipped(self):
        """Binary weights that changed sign in the last step (0 before the first step).

        Read lazily: the count stays on the parameters' device during the step, and asking
        for it here waits for the device (one synchronisation per device)."""
        return sum(int(t) for t in self._flip_counts)

    @property
    def flip_counts(self):
        """The last step's flip counts as they lie: a tuple of int64 tensors, one per device of
        the binary parameters (empty before the first step). Nothing waits for the device, so
        a training loop can add them up on the device and read the total once an epoch."""
        return tuple(self._flip_counts)

    @staticmethod
    def _sign(t):
        """sign with sign(0) = +1 (SPEC §1), as float."""
        return torch.where(t >= 0, 1.0, -1.0).to(torch.float32)

    def _initial_v(self, p):
        """v = -sign(w) * delta, delta uniform in (0, 1e-3] (drawn on the CPU, then moved)."""
        u = torch.rand(p.shape, generator=self._generator, dtype=torch.float64)
        delta = ((1.0 - u) * 1e-3).to(torch.float32).to(p.device)  # 1 - u in (0, 1]
        return -self._sign(p) * delta

    def _op(self, name, *args, **kwargs):
        """torch._foreach_<name>(*args) when foreach is on and this torch has it, else the
        tensor method <name> applied element by element of the lists (list arguments are
        zipped, scalars broadcast; a list of scalars, ScalarList, is zipped too)."""
        fn = getattr(torch, "_foreach_" + name, None) if self.foreach else None
        if fn is not None:
            return fn(*args, **kwargs)
        n = len(args[0])
        rows = [[a[i] if isinstance(a, (list, tuple)) else a for a in args] for i in range(n)]
        out = [getattr(row[0], name)(*row[1:], **kwargs) for row in rows]
        return None if name.endswith("_") else out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        binary, floats = {}, {}  # (group index, device) -> parameters, in parameter order
        for k, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype == torch.int8:
                    state = self.state[p]
                    if not state:  # drawn in parameter order from the generator
                        state["m"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                        state["v"] = self._initial_v(p)
                    binary.setdefault((k, p.device), []).append(p)
                elif p.is_floating_point():
                    floats.setdefault((k, p.device, p.dtype), []).append(p)
        counts = {}
        for (k, device), params in binary.items():
            count = self._flip(params, self.param_groups[k])
            counts.setdefault(device, []).append(count)
        for (k, _, _), params in floats.items():
            self._adam(params, self.param_groups[k])
            self._floor_scales(params, self.param_groups[k])
        self._flip_counts = [c[0] if len(c) == 1 else torch.stack(c).sum()
                             for c in counts.values()]
        return loss

    def _flip(self, params, group):
        """One sign-flip step over int8 parameters of one device; returns the number of
        flips as a 0-dim device tensor. With foreach on a GPU, every tensor of the step is one
        flat tensor over all ``params`` (a handful of operations per step, whatever the number
        of layers: a GPU step is bound by launches); else, and on the CPU (where a layer's
        tensors stay in cache between operations and whole-model passes would not: 1.8x
        slower there), the same arithmetic tensor by tensor, bit for bit the same."""
        beta1, beta2 = group["betas"]
        if self.foreach and params[0].device.type in _FLAT_DEVICE_TYPES:
            m, v = self._flat_states(params)
            grads = [p.grad.reshape(-1) for p in params]
            if all(g.dtype == grads[0].dtype for g in grads):
                g = torch.cat(grads).to(torch.float32)
            else:
                g = torch.cat([t.to(torch.float32) for t in grads])
            w = torch.cat([p.detach().reshape(-1) for p in params])
            count = self._flip_tensor(w, m, v, g, group["lr"], beta1, beta2)
            pieces = [t.view(p.shape) for t, p in zip(w.split([p.numel() for p in params]),
                                                       params)]
            copy_all([p.detach() for p in params], pieces)
            return count
        counts = [self._flip_tensor(p.detach(), self.state[p]["m"], self.state[p]["v"],
                                    p.grad.to(torch.float32), group["lr"], beta1, beta2)
                  for p in params]
        return counts[0] if len(counts) == 1 else torch.stack(counts).sum()

    def _floor_scales(self, params, group):
        """scale_a_floor: every bie layer's scale_a among ``params`` (float parameters of
        one device and dtype) at or above that fraction of its value after its first step;
        on the device, no wait."""
        fraction = group.get("scale_a_floor")
        scales = [p for p in params if getattr(p, "_bie_scale_a", False)] if fraction else []
        if not scales:
            return
        floors = []
        for p in scales:
            state = self.state[p]
            if "scale_a_floor" not in state:  # its first step sets the floor
                state["scale_a_floor"] = p.detach().mul(fraction)
            floors.append(state["scale_a_floor"])
        values = [p.detach() for p in scales]
        if self.foreach and hasattr(torch, "_foreach_maximum_"):
            torch._foreach_maximum_(values, floors)
        else:
            for value, floor in zip(values, floors):
                torch.maximum(value, floor, out=value)

    @staticmethod
    def _flip_tensor(w, m, v, g, lr, beta1, beta2):
        """SPEC §5 on one int8 tensor ``w`` (in place) with its states; the flip count."""
        m.lerp_(g, 1.0 - beta1)
        target = torch.sign(m).mul_(lr)  # sgn0: torch.sign(0) = 0
        v.lerp_(target, 1.0 - beta2)
        # -sign(v) != sign(w), sign(0) = +1  <=>  (v >= 0) == (w >= 0)
        flip = torch.eq(v >= 0, w >= 0)
        flipped_values = torch.where(w == 0, -1, torch.neg(w))  # 0 flips to -1
        torch.where(flip, flipped_values, w, out=w)
        return flip.sum()

    def _flat_states(self, params, dtype=torch.float32):
        """m and v of ``params`` as two flat ``dtype`` tensors whose consecutive pieces are the
        parameters' states (``self.state[p]["m"]`` is a view of the flat m). Made again, the
        values copied in, when the list of parameters changes (a parameter without a
        gradient this step) or a state was replaced (``load_state_dict``)."""
        key = (dtype,) + tuple(id(p) for p in params)
        flat = self._flat.get(key)
        if flat is not None:
            m, v, ms, vs = flat
            if all(self.state[p]["m"] is a and self.state[p]["v"] is b
                   for p, a, b in zip(params, ms, vs)):
                return m, v
        sizes = [p.numel() for p in params]
        m = torch.cat([self.state[p]["m"].reshape(-1).to(dtype) for p in params])
        v = torch.cat([self.state[p]["v"].reshape(-1).to(dtype) for p in params])
        ms = [t.view(p.shape) for t, p in zip(m.split(sizes), params)]
        vs = [t.view(p.shape) for t, p in zip(v.split(sizes), params)]
        for p, a, b in zip(params, ms, vs):
            self.state[p]["m"], self.state[p]["v"] = a, b
        ids = set(key[1:])  # entries sharing a parameter hold replaced states now
        self._flat = {k: f for k, f in self._flat.items() if ids.isdisjoint(k[1:])}
        self._flat[key] = (m, v, ms, vs)
        return m, v

    def _adam(self, params, group):
        """One Adam(W) step over floating-point parameters of one device and dtype."""
        capturable = bool(group.get("capturable", False))
        ms, vs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = _step_state(state["step"], capturable, p.device)
            if not capturable:
                state["step"] += 1
            ms.append(state["m"])
            vs.append(state["v"])
            steps.append(state["step"])
        if capturable:
            self._op("add_", steps, 1.0)
            if self.foreach and params[0].device.type in _FLAT_DEVICE_TYPES:
                self._adam_flat(params, steps, group)
                return
        beta1, beta2 = group["float_betas"]
        lr, decay = group["float_lr"], group["weight_decay"]
        grads = [p.grad for p in params]
        if decay:
            if group["decoupled_weight_decay"]:
                self._op("mul_", params, 1.0 - lr * decay)
            else:
                grads = self._op("add", grads, params, alpha=decay)
        self._op("mul_", ms, beta1)
        self._op("add_", ms, grads, alpha=1.0 - beta1)
        self._op("mul_", vs, beta2)
        self._op("addcmul_", vs, grads, grads, value=1.0 - beta2)
        if capturable:  # bias corrections from the step counts on the device
            for p, m, v, t in zip(params, ms, vs, steps):
                denom = torch.div(v, 1.0 - torch.pow(beta2, t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom.mul_(1.0 - torch.pow(beta1, t)).div_(-lr))
            return
        denom = self._op("div", vs, [1.0 - beta2 ** s for s in steps])
        self._op("sqrt_", denom)
        self._op("add_", denom, group["eps"])
        step_sizes = [-lr / (1.0 - beta1 ** s) for s in steps]
        if self.foreach and hasattr(torch, "_foreach_addcdiv_"):
            torch._foreach_addcdiv_(params, ms, denom, step_sizes)
        else:
            for p, m, d, size in zip(params, ms, denom, step_sizes):
                p.addcdiv_(m, d, value=size)

    def _adam_flat(self, params, steps, group):
        """The capturable Adam step of ``params`` (one device and dtype) on flat tensors, in a
        fixed number of operations whatever the number of parameters (per parameter, the
        bias corrections made the step a dozen launches a tensor). The parameters and
        gradients are gathered with one ``cat`` each and the new values copied back; m and v
        are pieces of one flat tensor each (_flat_states); each parameter's bias corrections
        are computed from its step count and spread over its elements. Element for element
        the arithmetic of the per-parameter step, so the results are bit-identical."""
        beta1, beta2 = group["float_betas"]
        lr, decay = group["float_lr"], group["weight_decay"]
        m, v = self._flat_states(params, params[0].dtype)
        sizes = [p.numel() for p in params]
        w = torch.cat([p.detach().reshape(-1) for p in params])
        g = torch.cat([p.grad.reshape(-1).to(w.dtype) for p in params])
        if decay:
            if group["decoupled_weight_decay"]:
                w.mul_(1.0 - lr * decay)
            else:
                g = torch.add(g, w, alpha=decay)
        m.mul_(beta1)
        m.add_(g, alpha=1.0 - beta1)
        v.mul_(beta2)
        v.addcmul_(g, g, value=1.0 - beta2)
        t = torch.stack(steps)
        key = (t.device,) + tuple(sizes)
        counts = self._spread.get(key)
        if counts is None:  # made at the first step (before any capture), then reused
            counts = self._spread[key] = torch.tensor(sizes, dtype=torch.int64, device=t.device)
        # each element's parameter (output_size given: no wait for the device)
        owner = torch.repeat_interleave(counts, output_size=w.numel())

        def spread(c):
            return c.index_select(0, owner)

        denom = torch.div(v, spread(1.0 - torch.pow(beta2, t))).sqrt_().add_(group["eps"])
        w.addcdiv_(m, denom.mul_(spread(1.0 - torch.pow(beta1, t))).div_(-lr))
        pieces = [piece.view(p.shape) for piece, p in zip(w.split(sizes), params)]
        # contiguous parameters in one multi-tensor copy (a list with any other layout, e.g.
        # a channels-last conv weight, is copied tensor by tensor), the others after them
        for part in (True, False):
            idx = [i for i, p in enumerate(params) if p.is_contiguous() == part]
            if idx:
                copy_all([params[i].detach() for i in idx], [pieces[i] for i in idx])


def _step_state(step, capturable, device):
    """An Adam step count as the mode keeps it: a Python int, or with ``capturable`` a float32
    0-dim tensor on the parameter's device (a state of the other mode, e.g. loaded from a
    checkpoint, is converted once: a copy to or from the device)."""
    if capturable:
        if not torch.is_tensor(step):
            return torch.tensor(float(step), dtype=torch.float32, device=device)
        if step.device != device or step.dtype != torch.float32:
            return step.to(device=device, dtype=torch.float32)
        return step
    return int(step) if torch.is_tensor(step) else step


_amp = getattr(torch, "amp", None)
_GradScalerBase = getattr(_amp, "GradScaler", None) or torch.cuda.amp.GradScaler


class _FloatGradients:
    """What a GradScaler reads of an optimizer (its param_groups), without the parameters
    whose gradient is not floating point."""

    def __init__(self, optimizer):
        self.param_groups = [
            {**group, "params": [p for p in group["params"]
                                 if p.grad is None or p.grad.is_floating_point()]}
            for group in optimizer.param_groups]


class GradScaler(_GradScalerBase):
    """torch's ``GradScaler`` (loss scaling for float16 mixed precision) for optimizers that
    hold bie's int8 binary weights, such as :class:`SignFlip`. torch's unscales and checks
    every gradient of the optimizer and has no kernel for int8 ones; this one unscales and
    checks the floating-point gradients only. An int8 weight gradient needs neither: it is the
    per-tensor quantization of the float gradient (SPEC §1), which a power-of-two loss scale
    does not change (the scale only keeps float16 gradients from underflowing), and a step
    whose float gradients overflowed is skipped as a whole. Same arguments as torch's
    (``GradScaler("cuda")``; before torch 2.3, ``torch.cuda.amp.GradScaler``'s)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(_FloatGradients(optimizer), inv_scale, found_inf,
                                       allow_fp16)
