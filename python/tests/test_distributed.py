"""Data-parallel training under torch.distributed: 2 gloo processes on the CPU train a model
with every bie kind under DistributedDataParallel (ddp_check.py), each on its own data; every
parameter, buffer and optimizer state must then be bit-identical on both ranks. The same
training with bie's data-parallel support switched off must drift apart (so the check can
fail), and the first step's reduced gradients must be the means of the ranks' own (each
recomputed on a deepcopy of the model, which like eval() must keep scale_a)."""

import pytest
import torch

import bie

import ddp_check  # noqa: E402  (python/tests is on sys.path under pytest)

WORLD = 2

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch has no torch.distributed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 2 ranks (one process each) and return what each saved."""
    tmp = tmp_path_factory.mktemp("ddp")
    return ddp_check.run_gloo_ranks("ddp_check.py", WORLD, [],
                                    [tmp / f"rank{rank}.pt" for rank in range(WORLD)], 180)


def test_every_parameter_buffer_and_state_identical(ranks):
    fixed = [r["fixed"] for r in ranks]
    names = fixed[0].keys()
    # what the check covers: every kind's parameters, batch norm's buffers, both optimizers
    for what in ("0.weight", "0.scale_a", "0.scale_w", "0.bias_a", "0.qweight", "3.weight",
                 "3.scale_a", "6.weight", "6.scale_a", "8.weight", "8.bias_a",
                 "1.running_mean", "7.running_var", "10.weight"):
        assert "state/" + what in names, what
    assert any(n.startswith("opt/") and n.endswith("/v") for n in names)
    assert ddp_check.mismatches(fixed) == []
    assert fixed[0]["state/0.weight"].dtype == torch.int8
    assert float(fixed[0]["state/0.scale_a"].reshape(())) > 0


def test_gradients_are_the_ranks_means(ranks):
    assert ddp_check.check_gradients([r["fixed"] for r in ranks]) == []


def test_copies_and_eval_keep_scale_a(ranks):
    """The gradient checks recompute each rank's gradient on a deepcopy of the model, and the
    final state is read after eval(): both rebuild the C layers from their values, which must
    keep scale_a (not measure it again on the next input)."""
    assert ddp_check.check_scale_a_kept([r["fixed"] for r in ranks]) == []
    assert ddp_check.check_scale_a_kept([r["drifted"] for r in ranks]) == []
    assert any(n.startswith("local_scale_a/") for n in ranks[0]["fixed"])
    assert "trained/0.scale_a" in ranks[0]["fixed"]


def test_the_checks_can_fail(ranks):
    """Gradients not averaged, a copy that measured scale_a again, and eval() changing scale_a
    are each reported."""
    fixed = [dict(r["fixed"]) for r in ranks]
    un = [dict(r) for r in fixed]  # rank 0 keeps its own gradients: DDP did not average
    for name in list(un[0]):
        if name.startswith("local_grad/"):
            un[0]["grad/" + name[len("local_grad/"):]] = un[0][name]
        if name.startswith("local_float_grad/"):
            layer = name[len("local_float_grad/"):]
            un[0]["float_grad/" + layer] = un[0][name]
            un[0][f"grad/{layer}.weight"] = bie.distributed.quantize_int8(un[0][name])
    problems = ddp_check.check_gradients(un)
    for what in ("0.bias_a: DDP's gradient", "10.weight: DDP's gradient",
                 "0: weight_float_grad()", "6: weight_float_grad()"):
        assert any(p.startswith(what) for p in problems), (what, problems)
    remeasured = [dict(r) for r in fixed]
    t = remeasured[1]["local_scale_a/0"].clone()
    t[2] *= 2
    remeasured[1]["local_scale_a/0"] = t
    remeasured[0]["state/8.scale_a"] = remeasured[0]["state/8.scale_a"] * 0.5
    problems = ddp_check.check_scale_a_kept(remeasured)
    assert len(problems) == 2, problems
    assert any(p.startswith("0: the deepcopy's forward measured scale_a again")
               and "on rank 1)" in p for p in problems), problems
    assert any(p.startswith("eval() changed 8.scale_a (") and p.endswith("on rank 0)")
               for p in problems), problems


def test_a_layer_used_twice_per_forward(ranks):
    """A binary layer used twice in each forward: every parameter the same on both ranks, and
    its reduced gradient the mean of the ranks' own (the sum of its two uses', as without
    DDP)."""
    shared = [r["shared"] for r in ranks]
    assert "float_grad/2" in shared[0]
    assert ddp_check.mismatches(shared) == []
    assert ddp_check.check_gradients(shared) == []


def test_gradient_accumulation_under_no_sync(ranks):
    """A backward under no_sync() then a synchronised one: every parameter the same on both
    ranks, and the reduced gradient the mean of the ranks' accumulated (summed) ones."""
    accumulated = [r["accumulated"] for r in ranks]
    assert "float_grad/0" in accumulated[0]
    assert ddp_check.mismatches(accumulated) == []
    assert ddp_check.check_gradients(accumulated) == []


def test_what_ddp_and_bie_each_reduce(ranks):
    assert ddp_check.check_facts(ranks[0]["facts"]) == []


def test_ranks_drift_apart_without_it(ranks):
    """The same training without bie's data-parallel support (as before it had one): the int8
    weights and scale_a differ between the ranks, so the check above can fail."""
    assert ddp_check.check_drift([r["drifted"] for r in ranks], ranks[0]["drift_facts"]) == []


def test_quantize_int8_matches_the_backward():
    """bie.distributed.quantize_int8 is bit for bit what the C backward stores in weight.grad
    (SPEC §1), so a data-parallel int8 gradient is quantized as a single process's."""
    for layer, x in ((bie.BinaryLinearCutlass(40, 24), torch.randn(32, 40)),
                     (bie.BinaryConv2dCutlass(3, 5, 3, padding=1), torch.randn(4, 3, 9, 9))):
        bie.prepare_bie_layers(layer)
        layer(x).square().sum().backward()
        assert layer.weight.grad.dtype == torch.int8
        assert torch.equal(bie.distributed.quantize_int8(layer.weight_float_grad()),
                           layer.weight.grad)
    assert torch.equal(bie.distributed.quantize_int8(torch.zeros(3)),
                       torch.zeros(3, dtype=torch.int8))
    assert bie.distributed.active() is None  # no DDP forward running
