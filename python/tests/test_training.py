"""Training in torch with bie layers, and the sign-flip optimizer (SPEC §5)."""

import copy
import ctypes

import pytest
import torch
from torch import nn

import bie
from bie import _lib


def _sign(t):
    return torch.where(t >= 0, 1.0, -1.0)


def _initial_v(w, seed):
    """The documented initial v: -sign(w) * delta, delta = (1 - torch.rand) * 1e-3 from a
    generator seeded with ``seed`` (float64 draws)."""
    u = torch.rand(w.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    delta = ((1.0 - u) * 1e-3).float()
    return -_sign(w.float()) * delta


def _reference_step(w, m, v, g, lr, beta1, beta2):
    """SPEC §5 written out: returns the new w, m, v and the flip mask."""
    m = m + (g.float() - m) * (1 - beta1)
    v = v + (torch.sign(m) * lr - v) * (1 - beta2)  # sgn0(m): sign(0) = 0
    flip = -_sign(v) != _sign(w.float())
    flipped = torch.where(w == 0, torch.full_like(w, -1), -w)
    return torch.where(flip, flipped, w), m, v, flip


def test_signflip_initial_state():
    w = torch.randint(-127, 128, (40, 50), dtype=torch.int8)
    w[0, :3] = 0  # sign(0) = +1: v < 0
    p = nn.Parameter(w.clone(), requires_grad=False)
    opt = bie.SignFlip([p], seed=5)
    p.grad = torch.zeros_like(w)
    opt.step()
    v0 = _initial_v(w, 5)
    assert ((v0.abs() > 0) & (v0.abs() <= 1e-3)).all()
    assert (torch.where(w < 0, v0 > 0, v0 < 0)).all()
    assert abs(float(v0.abs().mean()) - 5e-4) < 5e-5  # uniform in (0, 1e-3]
    state = opt.state[p]
    assert torch.equal(state["m"], torch.zeros(40, 50))
    torch.testing.assert_close(state["v"], v0 * 0.9999, rtol=1e-6, atol=0)  # one zero step
    # the same seed gives the same state; by default torch's generator decides the seed
    for make in (lambda q: bie.SignFlip([q], seed=5), lambda q: bie.SignFlip([q])):
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            q = nn.Parameter(w.clone(), requires_grad=False)
            o = make(q)
            q.grad = torch.zeros_like(w)
            o.step()
            runs.append(o.state[q]["v"])
        assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], state["v"])


@pytest.mark.parametrize("betas", [(0.99, 0.9999), (0.9, 0.99), (0.5, 0.6)])
def test_zero_gradient_never_flips(betas):
    w = torch.randint(-128, 128, (33, 17), dtype=torch.int8)
    w[0, :4] = torch.tensor([0, -128, 127, 1], dtype=torch.int8)
    p = nn.Parameter(w.clone(), requires_grad=False)
    opt = bie.SignFlip([p], lr=1e-2, betas=betas, seed=1)
    for _ in range(1000):
        p.grad = torch.zeros_like(w)
        opt.step()
        assert opt.flipped == 0
    assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("rows,lr,betas,steps", [(9, 1e-3, (0.9, 0.99), 1000),
                                                 (200, 1e-4, (0.99, 0.9999), 1000),
                                                 (9, 1e-2, (0.5, 0.6), 200)])
def test_signflip_matches_formula(rows, lr, betas, steps):
    shape = (rows, 13)
    w = torch.randint(-127, 128, shape, dtype=torch.int8)
    w[0, :3] = 0  # zero weights flip to -1
    w[1, 0] = -128  # flips to 127
    p = nn.Parameter(w.clone(), requires_grad=False)
    opt = bie.SignFlip([p], lr=lr, betas=betas, seed=11)
    m, v = torch.zeros(shape), _initial_v(w, 11)
    expect = w.clone()
    bias = (torch.arange(13) % 7 - 3) * 20  # some signs persist, some alternate
    dead = torch.zeros(shape, dtype=torch.bool)
    dead[:, 4] = True  # these gradients stay 0
    total = 0
    for _ in range(steps):
        g = (torch.randint(-127, 128, shape) + bias).clamp(-127, 127).to(torch.int8)
        g[dead | (torch.rand(shape) < 0.125)] = 0  # exact zeros
        p.grad = g
        opt.step()
        expect, m, v, flip = _reference_step(expect, m, v, g, lr, *betas)
        assert opt.flipped == int(flip.sum())
        assert torch.equal(p.detach(), expect)
        total += opt.flipped
    torch.testing.assert_close(opt.state[p]["v"], v, rtol=1e-5, atol=1e-5 * lr)
    assert total > 0
    assert torch.equal(p.detach()[dead], w[dead])


def test_signflip_agrees_with_the_c_library():
    fn = getattr(_lib.lib(), "bie_signflip_step", None)
    init = getattr(_lib.lib(), "bie_signflip_init", None)
    if fn is None or init is None:
        pytest.skip("this libbie has no bie_signflip_step / bie_signflip_init")
    w = torch.randint(-127, 128, (5, 7), dtype=torch.int8)
    w[0, 0] = 0
    cw, m, v = w.clone(), torch.zeros(5, 7), torch.zeros(5, 7)
    g = torch.zeros(5, 7, dtype=torch.int8)
    descs = [_lib.describe(t) for t in (cw, g, m, v)]
    status = init(ctypes.byref(descs[0]), ctypes.byref(descs[2]), ctypes.byref(descs[3]),
                  ctypes.c_uint64(17))
    if status == _lib.ERR_UNSUPPORTED:
        pytest.skip("bie_signflip_init is not implemented in this libbie yet")
    _lib.check(status)
    assert torch.equal(m, torch.zeros(5, 7))
    assert ((-_sign(w.float()) * v > 0) & (v.abs() <= 1e-3)).all()
    p = nn.Parameter(w.clone(), requires_grad=False)
    opt = bie.SignFlip([p], lr=1e-3, betas=(0.9, 0.99))
    opt.state[p] = {"m": m.clone(), "v": v.clone()}  # the C library's initial state
    flipped = ctypes.c_int64()
    for step in range(200):
        g.copy_(torch.randint(-127, 128, (5, 7), dtype=torch.int8))
        g[:, 3] = 0
        g[torch.rand(5, 7) < 0.125] = 0
        _lib.check(fn(*(ctypes.byref(d) for d in descs), 1e-3, 0.9, 0.99, ctypes.byref(flipped)))
        p.grad = g.clone()
        opt.step()
        assert torch.equal(p.detach(), cw) and opt.flipped == flipped.value, step
    torch.testing.assert_close(opt.state[p]["v"], v, rtol=1e-5, atol=1e-8)
    assert torch.equal(cw[:, 3], w[:, 3])  # zero gradient: never flipped


@pytest.mark.parametrize("decoupled", [True, False])
def test_float_parameters_take_adam_steps(decoupled):
    a = nn.Parameter(torch.randn(6, 4))
    b = nn.Parameter(a.detach().clone())
    ours = bie.SignFlip([a], float_lr=1e-2, weight_decay=0.1, decoupled_weight_decay=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    theirs = cls([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(6, 4)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_bad_optimizer_options():
    with pytest.raises(ValueError):
        bie.SignFlip([nn.Parameter(torch.ones(1))], lr=0)
    with pytest.raises(ValueError):
        bie.SignFlip([nn.Parameter(torch.ones(1))], betas=(0.9, 1.0))


def test_scale_a_floor_keeps_the_activation_scales_up():
    """scale_a_floor: each bie layer's scale_a stays at or above the fraction of its value
    after the first step; other float parameters (bias_a) take plain Adam steps."""
    torch.manual_seed(0)
    layers = [bie.BinaryLinearCutlass(12, 5), bie.Q4LinearCutlass(12, 5)]
    x = torch.randn(8, 12)
    for layer in layers:
        layer(x)  # scale_a measured from x
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    free = [p.detach().clone() for p in params]
    floored = bie.SignFlip(params, float_lr=0.05, scale_a_floor=0.5)
    after_first = None
    for step in range(40):  # a gradient that drives everything down
        for p in params:
            p.grad = torch.ones_like(p)
        floored.step()
        if step == 0:
            after_first = [layer.scale_a.detach().clone() for layer in layers]
    for layer, first in zip(layers, after_first):
        assert float(first) > 0
        torch.testing.assert_close(layer.scale_a.detach(), first * 0.5)
        assert float(layer.bias_a.min()) < -1.0  # unfloored: 40 steps of about 0.05
    # without the option the same steps take scale_a through zero
    plain = [nn.Parameter(t) for t in free]
    opt = bie.SignFlip(plain, float_lr=0.05)
    for _ in range(40):
        for p in plain:
            p.grad = torch.ones_like(p)
        opt.step()
    assert min(float(p.min()) for p in plain if p.numel() == 1) < 0
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError):
            bie.SignFlip(params, scale_a_floor=bad)


def _model():
    return nn.Sequential(
        bie.BinaryConv2dCutlass(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.PReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        bie.BinaryLinearCutlass(8 * 4 * 4, 32), nn.BatchNorm1d(32), nn.PReLU(),
        bie.Q4LinearCutlass(32, 3))


def test_a_few_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    images = torch.randn(96, 1, 8, 8)
    labels = torch.zeros(96, dtype=torch.long)  # class from the brightness of two regions
    labels[images[:, 0, :4].mean((1, 2)) > 0] = 1
    labels[images[:, 0, :, :4].mean((1, 2)) > 0.2] = 2
    model = _model()
    bie.prepare_bie_layers(model)
    opt = bie.SignFlip(model.parameters(), float_lr=1e-2)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-5:]) < 0.8 * losses[0]
    model.eval()
    with torch.no_grad():
        accuracy = (model(images).argmax(1) == labels).float().mean()
    assert accuracy > 0.5  # three classes: chance is about 1/3


def _mixed_model_params(seed):
    """int8 binary weights (two groups, one with a zero gradient now and then) and float
    parameters, with gradients drawn per step."""
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
          for shape in ((17, 9), (4, 3, 3, 5), (64,))]
    ws[0][0, :3] = 0
    fs = [torch.randn(shape, generator=gen) for shape in ((6, 4), (5,), (3, 4, 2, 2), (7,))]
    fs[2] = fs[2].contiguous(memory_format=torch.channels_last)
    return ws, fs


def _run_optimizer(foreach, steps=60, seed=3, reload_at=None, capturable=False):
    ws, fs = _mixed_model_params(seed)
    bins = [nn.Parameter(w.clone(), requires_grad=False) for w in ws]
    flts = [nn.Parameter(f.clone()) for f in fs]
    opt = bie.SignFlip([{"params": bins[:2] + flts[:1]},
                        {"params": bins[2:] + flts[1:], "lr": 1e-2, "betas": (0.5, 0.6)}],
                       lr=1e-3, betas=(0.9, 0.99), float_lr=1e-2, weight_decay=0.1,
                       seed=9, foreach=foreach, capturable=capturable)
    gen = torch.Generator().manual_seed(seed + 1)
    history = []
    for step in range(steps):
        for p in bins:
            p.grad = torch.randint(-127, 128, p.shape, generator=gen, dtype=torch.int8)
        for p in flts:
            p.grad = torch.randn(p.shape, generator=gen)
        if step % 7 == 3:
            bins[1].grad = None  # skipped this step
            flts[0].grad = None
        if step % 5 == 1:
            flts[2].grad = None  # its step count falls behind its group's others
        before = [p.detach().clone() for p in bins]
        if step == reload_at:  # states replaced by loaded copies
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt.step()
        changed = sum(int(((b >= 0) != (p.detach() >= 0)).sum()) for b, p in zip(before, bins))
        history.append((opt.flipped, changed))
    return bins, flts, opt, history


@pytest.fixture(params=[False, True], ids=["cpu_default", "flat"])
def flat_on_cpu(request, monkeypatch):
    """Whether the foreach step runs the binary update on flat tensors on the CPU too (by
    default only on CUDA), so that both forms are held to the per-parameter step here."""
    if request.param:
        monkeypatch.setattr(bie.optim, "_FLAT_DEVICE_TYPES", ("cpu", "cuda"))
    return request.param


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("reload_at", [None, 20])
def test_foreach_and_per_parameter_steps_agree_bit_for_bit(reload_at, capturable, flat_on_cpu):
    a_bins, a_flts, a_opt, a_hist = _run_optimizer(True, reload_at=reload_at,
                                                   capturable=capturable)
    b_bins, b_flts, b_opt, b_hist = _run_optimizer(False, reload_at=reload_at,
                                                   capturable=capturable)
    assert a_hist == b_hist
    for p, q in zip(a_bins + a_flts, b_bins + b_flts):
        assert torch.equal(p.detach(), q.detach())
        for key in a_opt.state[p]:
            x, y = a_opt.state[p][key], b_opt.state[q][key]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y


def test_flat_capturable_step_runs_a_fixed_number_of_operations(monkeypatch):
    """capturable with foreach on flat tensors: the operations of a step do not grow with
    the number of float parameters (per parameter they would: about a dozen each)."""
    if not hasattr(torch, "_foreach_copy_"):
        pytest.skip("this torch copies the new values back tensor by tensor")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(n in str(func) for n in ("detach", "view", "split", "alias")):
                self.ops += 1  # an operation that computes (not a view of a tensor)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(bie.optim, "_FLAT_DEVICE_TYPES", ("cpu", "cuda"))

    def ops_of_a_step(n):
        gen = torch.Generator().manual_seed(n)
        params = [nn.Parameter(torch.randn(3 + i % 4, generator=gen)) for i in range(n)]
        opt = bie.SignFlip(params, float_lr=1e-2, seed=1, capturable=True)
        before = [p.detach().clone() for p in params]
        counted = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            with Count() as count:
                opt.step()
            counted.append(count.ops)
        assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
        return counted[-1]

    assert ops_of_a_step(40) == ops_of_a_step(5) < 40


def test_foreach_step_keeps_binary_states_in_one_buffer(monkeypatch):
    """With foreach, the binary parameters' m (and v) of a parameter group are pieces of one
    flat tensor, made again after load_state_dict replaced them."""
    def storages(opt, params, key):
        return {opt.state[p][key].storage().data_ptr() for p in params}

    monkeypatch.setattr(bie.optim, "_FLAT_DEVICE_TYPES", ("cpu", "cuda"))

    bins, _, opt, _ = _run_optimizer(True, steps=3)  # bins[:2]: group 0, bins[2]: group 1
    assert len(storages(opt, bins[:2], "m")) == 1 and len(storages(opt, bins[:2], "v")) == 1
    assert len(storages(opt, bins, "m")) == 2
    before = storages(opt, bins, "m")
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert storages(opt, bins, "m").isdisjoint(before)  # loaded copies
    for p in bins:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(storages(opt, bins[:2], "m")) == 1 and len(storages(opt, bins[:2], "v")) == 1


def test_flip_count_is_read_lazily_and_counts_sign_changes():
    bins, _, opt, history = _run_optimizer(True)
    assert all(torch.is_tensor(t) for t in opt._flip_counts)
    assert all(flipped == changed for flipped, changed in history)
    assert sum(flipped for flipped, _ in history) > 0
    assert opt.flipped == sum(int(t) for t in opt.flip_counts) == history[-1][0]
    assert all(t.dtype == torch.int64 and t.dim() == 0 for t in opt.flip_counts)
    fresh = bie.SignFlip([nn.Parameter(torch.ones(3))])
    assert fresh.flipped == 0 and fresh.flip_counts == ()


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("foreach", [True, False])
def test_step_does_not_synchronise(monkeypatch, foreach, capturable):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ws, fs = _mixed_model_params(4)
    params = ([nn.Parameter(w.to(device), requires_grad=False) for w in ws]
              + [nn.Parameter(f.to(device)) for f in fs])
    opt = bie.SignFlip(params, weight_decay=0.1, foreach=foreach, seed=2, capturable=capturable)

    def no_sync(*args, **kwargs):
        raise AssertionError("SignFlip.step synchronised with the device")

    for step in range(4):
        for p in params:
            p.grad = (torch.randint(-127, 128, p.shape, dtype=torch.int8, device=device)
                      if p.dtype == torch.int8 else torch.randn(p.shape, device=device))
        if step == 0:  # the first step draws the initial state (a copy to the device)
            opt.step()
            continue
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
                patch.setattr(torch.Tensor, name, no_sync)
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
        assert opt.flipped >= 0  # read outside the step


def _small_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(bie.BinaryLinearCutlass(16, 24), nn.Tanh(),
                          bie.BinaryLinearCutlass(24, 24), nn.Tanh(), nn.Linear(24, 5))
    bie.prepare_bie_layers(model)
    return model


def test_clip_grad_norm_of_float_parameters():
    """torch's clip_grad_norm_ rejects int8 gradients; over bie.float_parameters it clips the
    float ones and leaves the int8 weight gradients alone."""
    model = _small_model()
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    int8_grads = [p.grad.clone() for p in model.parameters() if p.dtype == torch.int8]
    assert len(int8_grads) == 2
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    floats = bie.float_parameters(model)
    assert floats == [p for p in model.parameters() if p.dtype != torch.int8]
    assert bie.float_parameters(model.parameters()) == floats
    total = torch.nn.utils.clip_grad_norm_(floats, 1e-3)
    assert float(total) > 1e-3
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                    for p in floats if p.grad is not None]))
    assert float(clipped) <= 1e-3 * (1 + 1e-5)
    assert all(torch.equal(a, p.grad) for a, p in
               zip(int8_grads, [p for p in model.parameters() if p.dtype == torch.int8]))


def _cpu_grad_scaler_available():
    amp = getattr(torch, "amp", None)
    if getattr(amp, "GradScaler", None) is None:
        return False
    try:
        amp.GradScaler("cpu")
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _cpu_grad_scaler_available(), reason="needs torch.amp.GradScaler('cpu')")
def test_grad_scaler_trains_as_without_it():
    """bie.GradScaler with SignFlip: the same parameters as training without loss scaling (a
    power-of-two scale changes no rounding), a step with an overflowed gradient skipped, and
    torch's own GradScaler failing on the int8 gradients (why bie has one)."""
    def train(scaler, steps=4, overflow_at=None):
        model = _small_model(3)
        opt = bie.SignFlip(model.parameters(), lr=1e-2, betas=(0.9, 0.99), float_lr=1e-2,
                           seed=2)
        gen = torch.Generator().manual_seed(4)
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
                continue
            scaler.scale(loss).backward()
            if step == overflow_at:
                model[4].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return model

    plain = train(None)
    scaled = train(bie.GradScaler("cpu", init_scale=2.0 ** 12))
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        assert torch.equal(p, q), name
    skipped = train(bie.GradScaler("cpu", init_scale=2.0 ** 12), steps=1, overflow_at=0)
    for (name, p), q in zip(_small_model(3).named_parameters(), skipped.parameters()):
        if not name.endswith("scale_a"):  # (measured by the first forward)
            assert torch.equal(p, q), name  # the step was skipped
    with pytest.raises(RuntimeError):
        train(torch.amp.GradScaler("cpu", init_scale=2.0 ** 12), steps=1)


def test_int8_gradients_accumulate_as_torch_gradients_do():
    """Two backwards without zero_grad: the int8 weight's gradient is the quantization of the
    sum of the two float gradients (which weight_float_grad() reports), as torch adds the float
    parameters' gradients; after zero_grad (to None or in place) a backward starts afresh."""
    import warnings
    model = _small_model(5)
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    ref = copy.deepcopy(model)
    floats = []
    for x in (x1, x2):
        ref.zero_grad(set_to_none=True)
        ref(x).sum().backward()
        floats.append([m.weight_float_grad() for m in (ref[0], ref[2])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for set_to_none in (True, False):
            model.zero_grad(set_to_none=set_to_none)
            model(x1).sum().backward()
            model(x2).sum().backward()
            for k, m in enumerate((model[0], model[2])):
                total = floats[0][k] + floats[1][k]
                assert torch.equal(m.weight_float_grad(), total)
                assert torch.equal(m.weight.grad, bie.distributed.quantize_int8(total))
                assert m.weight.grad.dtype == torch.int8
        model.zero_grad(set_to_none=False)
        model(x2).sum().backward()  # in-place zeroed: afresh
        assert torch.equal(model[0].weight_float_grad(), floats[1][0])


def test_a_layer_used_twice_adds_its_gradients():
    """A binary layer applied twice in a forward (shared weight, keep_inputs) gets the sum of
    the two uses' gradients, as two separate layers with the same parameters get each."""
    torch.manual_seed(7)
    shared = bie.BinaryLinearCutlass(12, 12, keep_inputs=True)
    shared.prepare_params()
    with torch.no_grad():
        shared.scale_a.fill_(0.6)  # set, so that no forward measures it
    first, second = copy.deepcopy(shared), copy.deepcopy(shared)
    x = torch.randn(5, 12)
    shared(torch.tanh(shared(x))).square().sum().backward()
    second(torch.tanh(first(x))).square().sum().backward()
    total = first.weight_float_grad() + second.weight_float_grad()
    assert torch.equal(shared.weight_float_grad(), total)
    assert torch.equal(shared.weight.grad, bie.distributed.quantize_int8(total))
    torch.testing.assert_close(shared.bias_a.grad, first.bias_a.grad + second.bias_a.grad)


def test_gradient_of_a_replaced_layer_is_not_accumulated(monkeypatch):
    """When the C layer was replaced between two backwards (here by a new word size), the
    float gradient the int8 one quantizes is gone: the second backward's replaces it, with a
    warning."""
    from bie import _layer
    monkeypatch.setattr(_layer, "_warned_accumulation", False)
    torch.manual_seed(2)
    m = bie.BinaryLinearCutlass(16, 8)
    m.prepare_params()
    x = torch.randn(3, 16)
    m(x).sum().backward()
    m.set_bits_binary_word(32)
    ref = copy.deepcopy(m)
    with pytest.warns(RuntimeWarning, match="cannot be accumulated"):
        m(x).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(m.weight.grad, ref.weight.grad)
    assert torch.equal(m.weight_float_grad(), ref.weight_float_grad())


@pytest.mark.parametrize("foreach", [True, False])
def test_capturable_steps_keep_counts_on_the_device(foreach):
    """capturable=True: the binary parameters and their states bit for bit the default
    mode's, the float parameters within float32 rounding (bias corrections computed in
    float32), Adam's step counts float32 tensors; a state_dict round trip (also into and out
    of the default mode) continues as the uninterrupted run does."""
    a_bins, a_flts, a_opt, a_hist = _run_optimizer(foreach)
    b_bins, b_flts, b_opt, b_hist = _run_optimizer(foreach, capturable=True)
    assert a_hist == b_hist
    for p, q in zip(a_bins, b_bins):
        assert torch.equal(p, q)
        for key in ("m", "v"):
            assert torch.equal(a_opt.state[p][key], b_opt.state[q][key])
    for p, q in zip(a_flts, b_flts):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        step = b_opt.state[q]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32
        assert float(step) == a_opt.state[p]["step"]
    c_bins, c_flts, c_opt, _ = _run_optimizer(foreach, capturable=True, reload_at=20)
    for p, q in zip(b_bins + b_flts, c_bins + c_flts):
        assert torch.equal(p, q)
    # a capturable state loaded by a default-mode optimizer, and back
    fresh = bie.SignFlip([{"params": g["params"]} for g in b_opt.param_groups],
                         foreach=foreach)
    fresh.load_state_dict(copy.deepcopy(b_opt.state_dict()))
    assert fresh.param_groups[0]["capturable"] is True
    for group in fresh.param_groups:
        group["capturable"] = False
    fresh.step()
    assert all(type(fresh.state[q]["step"]) is int for q in b_flts if q.grad is not None)
