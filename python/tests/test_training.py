"""Training in torch with bie layers, and the sign-flip optimizer (SPEC §5)."""

import ctypes

import pytest
import torch
from torch import nn

import bie
from bie import _lib


def _sign(t):
    return torch.where(t >= 0, 1.0, -1.0)


def test_signflip_matches_formula():
    w = torch.randint(-127, 128, (9, 13), dtype=torch.int8)
    w[0, :3] = 0  # zero weights flip to -1
    p = nn.Parameter(w.clone(), requires_grad=False)
    opt = bie.SignFlip([p], lr=1e-3, betas=(0.9, 0.99))
    m = torch.zeros(9, 13)
    v = torch.zeros(9, 13)
    expect = w.clone()
    for _ in range(4):
        g = torch.randint(-127, 128, (9, 13), dtype=torch.int8)
        p.grad = g
        opt.step()
        m = m + (g.float() - m) * 0.1
        v = v + (_sign(m) * 1e-3 - v) * 0.01
        flip = -_sign(v) != _sign(expect.float())
        flipped = torch.where(expect == 0, torch.full_like(expect, -1), -expect)
        assert opt.flipped == int(flip.sum())
        expect = torch.where(flip, flipped, expect)
        assert torch.equal(p.detach(), expect)


def test_signflip_agrees_with_the_c_library():
    fn = getattr(_lib.lib(), "bie_signflip_step", None)
    if fn is None:
        pytest.skip("this libbie has no bie_signflip_step")
    w = torch.randint(-127, 128, (5, 7), dtype=torch.int8)
    g = torch.randint(-127, 128, (5, 7), dtype=torch.int8)
    cw, m, v = w.clone(), torch.zeros(5, 7), torch.zeros(5, 7)
    descs = [_lib.describe(t) for t in (cw, g, m, v)]
    flipped = ctypes.c_int64()
    status = fn(*(ctypes.byref(d) for d in descs), 1e-4, 0.99, 0.9999, ctypes.byref(flipped))
    if status == _lib.ERR_UNSUPPORTED:
        pytest.skip("bie_signflip_step is not implemented in this libbie yet")
    _lib.check(status)
    p = nn.Parameter(w.clone(), requires_grad=False)
    p.grad = g
    opt = bie.SignFlip([p])
    opt.step()
    assert torch.equal(p.detach(), cw) and opt.flipped == flipped.value


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
