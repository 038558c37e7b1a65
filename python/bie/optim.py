"""The sign-flip optimizer for int8 binary weights, with Adam(W) for float parameters (SPEC §5)."""

import math

import torch


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
    Runs on whatever device the parameters are on, with torch operations.
    """

    def __init__(self, params, lr=1e-4, betas=(0.99, 0.9999), float_lr=1e-3,
                 float_betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=True, seed=None):
        for name, value in (("lr", lr), ("float_lr", float_lr), ("eps", eps)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"SignFlip: {name} must be finite and > 0, got {value}")
        for name, pair in (("betas", betas), ("float_betas", float_betas)):
            if len(pair) != 2 or not all(0.0 <= b < 1.0 for b in pair):
                raise ValueError(f"SignFlip: {name} must be two values in [0, 1), got {pair}")
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(f"SignFlip: weight_decay must be finite and >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), float_lr=float_lr,
                        float_betas=tuple(float_betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        if seed is None:
            seed = _same_on_every_rank(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
        self._generator = torch.Generator().manual_seed(int(seed))
        self.flipped = 0  # binary weights that changed sign in the last step

    @staticmethod
    def _sign(t):
        """sign with sign(0) = +1 (SPEC §1), as float."""
        return torch.where(t >= 0, 1.0, -1.0).to(torch.float32)

    def _initial_v(self, p):
        """v = -sign(w) * delta, delta uniform in (0, 1e-3] (drawn on the CPU, then moved)."""
        u = torch.rand(p.shape, generator=self._generator, dtype=torch.float64)
        delta = ((1.0 - u) * 1e-3).to(torch.float32).to(p.device)  # 1 - u in (0, 1]
        return -self._sign(p) * delta

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flipped = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype == torch.int8:
                    flipped += self._flip(p, group)
                elif p.is_floating_point():
                    self._adam(p, group)
        self.flipped = flipped
        return loss

    def _flip(self, p, group):
        state = self.state[p]
        if not state:
            state["m"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["v"] = self._initial_v(p)
        m, v = state["m"], state["v"]
        beta1, beta2 = group["betas"]
        m.lerp_(p.grad.to(torch.float32), 1.0 - beta1)
        v.lerp_(torch.sign(m) * group["lr"], 1.0 - beta2)  # sgn0: torch.sign(0) = 0
        flip = (-self._sign(v)) != self._sign(p)
        flipped_values = torch.where(p == 0, torch.full_like(p, -1), -p)  # 0 flips to -1
        p.copy_(torch.where(flip, flipped_values, p))
        return int(flip.sum().item())

    def _adam(self, p, group):
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step, m, v = state["step"], state["m"], state["v"]
        beta1, beta2 = group["float_betas"]
        lr, decay = group["float_lr"], group["weight_decay"]
        grad = p.grad
        if decay:
            if group["decoupled_weight_decay"]:
                p.mul_(1.0 - lr * decay)
            else:
                grad = grad.add(p, alpha=decay)
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (v / (1.0 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
