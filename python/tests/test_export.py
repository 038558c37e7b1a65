"""bie.export / bie.load: PyTorch models as bie model files (tools/bie/model_io.h), read back
by bie.load and run by the `bie` command of this checkout (found next to the libbie in use,
in the repository's build trees, or through BIE_CLI; those tests skip without it or without
Fashion-MNIST)."""

import gzip
import json
import os
import pathlib
import re
import subprocess
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import bie  # noqa: E402
from bie.export import read_safetensors, write_safetensors  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "README.md"  # its section "Train in PyTorch, deploy with `bie eval`"
DATA = pathlib.Path(os.environ.get("BIE_DATA_DIR", "/usr/share/datasets/fashion-mnist"))


# ---------------------------------------------------------------------- helpers


def _cli():
    """The `bie` command: BIE_CLI, else tools/bie beside the libbie in use, else the newest
    build tree's."""
    if os.environ.get("BIE_CLI"):
        return os.environ["BIE_CLI"]
    beside = pathlib.Path(bie.library_path()).resolve().parent / "tools" / "bie"
    builds = sorted(REPO.glob("build*/tools/bie"), key=lambda p: -p.stat().st_mtime)
    for path in [beside] + builds:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _usable_cli():
    """The bie command, if it is built with --logits and Fashion-MNIST is there; else skip."""
    path = _cli()
    if path is None or not os.access(path, os.X_OK):
        pytest.skip("the bie command is not built (cmake --build build) or BIE_CLI "
                    f"({os.environ.get('BIE_CLI')}) is not an executable")
    if "--logits" not in subprocess.run([path, "predict", "--help"], capture_output=True,
                                        text=True).stdout:
        pytest.skip(f"{path} predates `bie predict --logits`; rebuild it")
    if not ((DATA / "t10k-images-idx3-ubyte.gz").is_file()
            or (DATA / "t10k-images-idx3-ubyte").is_file()):
        pytest.skip(f"Fashion-MNIST is not installed in {DATA}")
    return path


@pytest.fixture(scope="module")
def cli():
    return _usable_cli()


def _run(*args):
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                         env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert out.returncode == 0, f"{args}: {out.stdout}{out.stderr}"
    return out.stdout


def _test_images(count, first=0):
    """Fashion-MNIST test images normalised as the `bie` command does."""
    path = DATA / "t10k-images-idx3-ubyte.gz"
    if path.is_file():
        with gzip.open(path) as f:
            raw = f.read()
    else:
        raw = (DATA / path.stem).read_bytes()
    pixels = torch.frombuffer(bytearray(raw[16 + 784 * first:16 + 784 * (first + count)]),
                              dtype=torch.uint8)
    return ((pixels.float() / 255.0 - 0.2860) / 0.3530).reshape(count, 1, 28, 28)


def _logits(cli, path, count, first=0):
    """`bie predict --logits` scores of test images first..first+count."""
    lines = _run(cli, "predict", path, "--first", first, "--count", count, "--logits",
                 "--threads", 2).splitlines()
    assert len(lines) == count and lines[0].startswith(f"test[{first}]:")
    return torch.tensor([[float(v) for v in line.split()[1:]] for line in lines])


def _train(model, steps=4):
    """A few sign-flip steps on random data (sets batch-norm statistics and scale_a)."""
    bie.prepare_bie_layers(model)
    optimizer = bie.SignFlip(model.parameters(), lr=1e-2, float_lr=2e-3)
    for _ in range(steps):
        x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def _architecture(path):
    return read_safetensors(path)[1]["architecture"]


def _check_exports_again(loaded, path, tensors):
    """bie.load's module exported again: the architecture and tensors of ``path``."""
    again = path.with_name("again.safetensors")
    bie.export(loaded, torch.randn(1, 1, 28, 28), again)
    assert _architecture(again) == _architecture(path)
    tensors2, _ = read_safetensors(again)
    assert tensors2.keys() == tensors.keys()
    for name, (dtype, t) in tensors.items():
        assert tensors2[name][0] == dtype and torch.equal(tensors2[name][1], t), name


# ---------------------------------------------------------------------- models


class Residual(nn.Module):
    """A small binary ResNet for 1x28x28 in the style of `bie train --model resnet`: float
    conv stem + BN + RPReLU, a binary conv + BN unit with a real-valued shortcut, a
    down-sampling unit (binary conv stride 2 + BN, shortcut average pool 2 + 1x1 conv + BN),
    a binary branch concatenated to its input, global pool, linear 10."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  bie.RPReLU(c))
        self.conv1, self.bn1, self.act1 = bie.BinaryConv2dBase(c, c, 3, padding=1), \
            nn.BatchNorm2d(c), bie.RPReLU(c)
        self.conv2 = bie.BinaryConv2dCutlass(c, 2 * c, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.down = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(c, 2 * c, 1, bias=False),
                                  nn.BatchNorm2d(2 * c))
        self.act2 = bie.RPReLU(2 * c)
        self.branch = nn.Sequential(bie.BinaryConv2dBase(2 * c, c, 3, padding=1),
                                    nn.BatchNorm2d(c))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3 * c, 10)

    def forward(self, x):
        x = self.stem(x)
        x = self.act1(self.bn1(self.conv1(x)) + x)
        x = self.act2(self.bn2(self.conv2(x)) + self.down(x))
        x = torch.cat([x, self.branch(x)], dim=1)
        return self.fc(torch.flatten(self.pool(x), 1))


class Mixed(nn.Module):
    """The other mappings: 4-bit conv and linear, max pool, ReLU (module, in-place, F.relu),
    x.view(x.size(0), -1), BatchNorm1d without affine, binary linear with 32-bit words and
    asymmetric inputs, PReLU (one slope and per channel), x.mean((2, 3)), torch.add, dropout."""

    def __init__(self):
        super().__init__()
        self.q4conv = bie.Q4Conv2dCutlass(1, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.bn = nn.BatchNorm2d(6)
        self.prelu = nn.PReLU()
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(6, 6, 3, stride=2, padding=1, dilation=1)
        self.binary = bie.BinaryLinearCutlass(6 * 7 * 7, 32, symmetric=False)
        self.binary.set_bits_binary_word(32)
        self.bn1 = nn.BatchNorm1d(32, affine=False)
        self.drop = nn.Dropout(0.1)
        self.prelu1 = nn.PReLU(32)
        self.q4fc = bie.Q4LinearCutlass(32 + 6, 10)

    def forward(self, x):
        x = self.bn(self.pool(self.q4conv(x)))
        x = self.relu(self.prelu(x))
        x = F.relu(self.conv(x))
        g = x.mean((2, 3))
        h = self.prelu1(self.drop(self.bn1(self.binary(x.view(x.size(0), -1)))))
        return self.q4fc(torch.cat((torch.add(h, h), g), 1))


class NormAct(nn.Module):
    """bie.BatchNormAct in each form: after a binary conv stem (per-channel slope, no res), in
    two residual units (one shared slope with res positional; prelu=False with res as a
    keyword) and on [N, C] after a linear layer (a batchnorm1d)."""

    def __init__(self, c=6):
        super().__init__()
        self.stem = bie.BinaryConv2dBase(1, c, 3, stride=2, padding=1)
        self.norm0 = bie.BatchNormAct(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm1 = bie.BatchNormAct(c, prelu_parameters=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = bie.BatchNormAct(c, prelu=False)
        self.fc1 = nn.Linear(c, 16)
        self.norm3 = bie.BatchNormAct(16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.norm0(self.stem(x))
        x = self.norm1(self.conv1(x), x)
        x = self.norm2(self.conv2(x), res=x)
        return self.fc2(self.norm3(self.fc1(x.mean((2, 3)))))


def _norm_act_model(seed):
    """NormAct after a few training steps, with random affine parameters, slopes (some
    negative) and running statistics, in eval mode."""
    torch.manual_seed(seed)
    model = _train(NormAct())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, bie.BatchNormAct):
                c = m.num_features
                m.weight.copy_(torch.randn(c) * 0.5 + 1)
                m.bias.copy_(torch.randn(c) * 0.3)
                m.running_mean.add_(torch.randn(c) * 0.2)
                m.running_var.mul_(torch.rand(c) + 0.5)
                if m.slope is not None:
                    m.slope.copy_(torch.rand(m.slope.shape) - 0.5)
    return model


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    torch.manual_seed(7)
    model = _train(Residual())
    path = tmp_path_factory.mktemp("export") / "residual.safetensors"
    bie.export(model, torch.randn(2, 1, 28, 28), path)
    return model, path


# ---------------------------------------------------------------------- tests


def test_rprelu_is_shift_prelu_shift():
    m = bie.RPReLU(3)
    with torch.no_grad():
        m.shift_in.copy_(torch.tensor([0.5, -1.0, 0.0]))
        m.weight.copy_(torch.tensor([0.25, -2.0, 1.5]))
        m.shift_out.copy_(torch.tensor([1.0, 0.0, -3.0]))
    for x in (torch.randn(4, 3), torch.randn(2, 3, 5, 5)):
        shape = (1, 3) + (1,) * (x.dim() - 2)
        t = x + m.shift_in.view(shape)
        want = torch.where(t >= 0, t, m.weight.view(shape) * t) + m.shift_out.view(shape)
        assert torch.equal(m(x), want)


def test_residual_network_round_trips_bit_for_bit(residual):
    model, path = residual
    kinds = {e["type"] for e in json.loads(_architecture(path))}
    assert kinds == {"conv2d", "batchnorm2d", "rprelu", "binary_conv2d", "add", "avgpool2d",
                     "concat", "global_avgpool", "flatten", "linear"}
    loaded = bie.load(path)
    assert loaded.input_shape == (1, 28, 28) and loaded.classes[9] == "Ankle boot"
    assert not loaded.training and not loaded.packed
    assert sum(isinstance(m, bie.BinaryConv2dBase) for m in loaded.modules()) == 3
    x = torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # The module's parameters are the file's, under the file's names.
    tensors, meta = read_safetensors(path)
    assert meta["packed"] == "false" and meta["input_shape"] == "[1, 28, 28]"
    state = loaded.state_dict()
    for name, (dtype, t) in tensors.items():
        assert torch.equal(state[name], t), name
    assert tensors["3.weight"][0] == "I8" and tensors["3.weight"][1].abs().max() <= 127
    # Exporting the loaded module writes the same architecture and tensors.
    _check_exports_again(loaded, path, tensors)


def test_export_restores_training_flags(residual, tmp_path):
    model, _ = residual
    model.train()
    model.stem[1].eval()
    bie.export(model, torch.randn(2, 1, 28, 28), tmp_path / "m.safetensors")
    assert model.training and not model.stem[1].training and model.conv1.training
    assert model.conv1.describe()["training"]
    model.eval()


def test_other_layers_round_trip(tmp_path):
    torch.manual_seed(3)
    model = _train(Mixed())
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        want = model(x)
    arch = bie.export(model, torch.randn(2, 1, 28, 28), tmp_path / "mixed.safetensors")
    kinds = [e["type"] for e in arch]
    assert kinds.count("q4_conv2d") == 1 and kinds.count("q4_linear") == 1
    assert {"maxpool2d", "batchnorm2d", "batchnorm1d", "prelu", "relu", "binary_linear",
            "flatten", "global_avgpool", "add", "concat", "conv2d"} == set(kinds) - {
                "q4_conv2d", "q4_linear"}
    binary = next(e for e in arch if e["type"] == "binary_linear")
    assert binary["bits_binary_word"] == 32 and binary["symmetric"] is False
    loaded = bie.load(tmp_path / "mixed.safetensors")
    with torch.no_grad():
        assert torch.equal(loaded(x), want)


def test_batch_norm_act_exports_as_batch_norm_add_prelu(tmp_path):
    """bie.BatchNormAct (prelu(bn(y) + res, slope)) becomes a batchnorm2d / 1d node, an add of
    the batch norm's output and res (in that order) when res is given and a prelu of the
    slope's C or 1 values when it has one; bie.load rebuilds nn.BatchNorm2d / 1d + add +
    nn.PReLU, which computes the same to float rounding (the fused call rounds once)."""
    model = _norm_act_model(13)
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        want = model(x)
    path = tmp_path / "norm_act.safetensors"
    arch = bie.export(model, torch.randn(2, 1, 28, 28), path)
    assert [e["type"] for e in arch] == [
        "binary_conv2d", "batchnorm2d", "prelu",  # norm0
        "conv2d", "batchnorm2d", "add", "prelu",  # norm1(conv1(x), x)
        "conv2d", "batchnorm2d", "add",  # norm2(conv2(x), res=x)
        "global_avgpool", "linear", "batchnorm1d", "prelu", "linear"]  # norm3 on [N, 16]
    assert arch[5]["inputs"] == [4, 2] and arch[9]["inputs"] == [8, 6]
    assert [e["in"] for e in arch if e["type"] == "prelu"] == [6, 1, 16]
    assert arch[1]["eps"] == pytest.approx(1e-5) and arch[1]["momentum"] == pytest.approx(0.1)
    tensors, _ = read_safetensors(path)
    for index, norm in ((1, model.norm0), (4, model.norm1), (8, model.norm2), (12, model.norm3)):
        for name in ("weight", "bias", "running_mean", "running_var"):
            assert torch.equal(tensors[f"{index}.{name}"][1], getattr(norm, name)), (index, name)
    for index, norm in ((2, model.norm0), (6, model.norm1), (13, model.norm3)):
        assert torch.equal(tensors[f"{index}.weight"][1], norm.slope)
    assert not model.training and not model.norm0.training
    loaded = bie.load(path)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in loaded.modules()) == 3
    assert [m.num_parameters for m in loaded.modules() if isinstance(m, nn.PReLU)] == [6, 1, 16]
    with torch.no_grad():
        got = loaded(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # The loaded module exports to the same file contents.
    _check_exports_again(loaded, path, tensors)


@pytest.mark.parametrize("kind", ["unprepared", "inference_only"])
def test_binary_and_4bit_weights_as_eval_mode_uses_them(kind, tmp_path):
    """A binary layer never prepared (float weight, scale_w 1) or inference-only (packed
    weight only), and 4-bit layers with only their packed codes, export what eval computes."""
    torch.manual_seed(5)
    model = nn.Sequential(bie.Q4Conv2dCutlass(1, 4, 3, stride=2), nn.BatchNorm2d(4),
                          bie.BinaryConv2dBase(4, 8, 3), nn.Flatten(),
                          bie.Q4LinearCutlass(8 * 11 * 11, 10))
    x = torch.randn(4, 1, 28, 28)
    for i in (0, 2, 4) if kind == "inference_only" else (0, 4):  # 4-bit: scale_w set
        model[i].prepare_params()
        if kind == "inference_only":
            model[i].generate_quantized_weight(qweight_only=True)
    model.eval()
    with torch.no_grad():
        want = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bie.export(model, x[:1], tmp_path / "m.safetensors")
    assert any("never prepared" in str(w.message) for w in caught) == (kind == "unprepared")
    with torch.no_grad():
        assert torch.equal(bie.load(tmp_path / "m.safetensors")(x), want)


UNSUPPORTED = [
    (lambda: _Wrap(lambda x: torch.sigmoid(x)),
     "unsupported operation 'torch.sigmoid' at node 'sigmoid'"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.Tanh()),
     "unsupported layer 'torch.nn.Tanh' (module '2') at node '_2'"),
    (lambda: _Wrap(lambda x: x.softmax(1)), "unsupported operation 'Tensor.softmax'"),
    (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, groups=1, padding_mode="reflect")),
     "padding_mode='reflect'"),
    (lambda: nn.Sequential(nn.Conv2d(1, 4, (3, 1))), "kernel_size=(3, 1) is not square"),
    (lambda: nn.Sequential(nn.MaxPool2d(2, padding=1), nn.Flatten()), "padding not supported"),
    (lambda: _Wrap(lambda x: x + 1), "an input is not a tensor computed by the model"),
    (lambda: _Wrap(lambda x: torch.cat([x, x], 2)), "torch.cat along dim 2"),
    (lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(1, 10, 1), nn.Flatten()),
     "without flattening it"),
    (lambda: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(784, track_running_stats=False)),
     "track_running_stats=False"),
    (lambda: _Wrap(lambda x: x.flatten(1)[:, :10]), "unsupported operation '_operator.getitem'"),
]


class _Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("make, message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_operations_are_named(make, message, tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(bie.BieError, match=re.escape(message)):
        bie.export(make(), torch.randn(2, 1, 28, 28), path)
    assert not path.exists() and not path.with_name("m.safetensors.partial").exists()


def _inplace(x):
    x2 = torch.relu(x)
    y = F.relu(x2, inplace=True)  # changes x2, which the add reads afterwards
    return torch.flatten(y + x2, 1)


def _inplace_last(x):
    x2 = torch.relu(x)
    x2 += x  # nothing reads x2 afterwards: the same as x2 + x
    return torch.flatten(x2, 1)


def test_in_place_operations(tmp_path):
    with pytest.raises(bie.BieError, match="in-place operation changes 'relu'"):
        bie.export(_Wrap(_inplace), torch.randn(2, 1, 28, 28), tmp_path / "m.safetensors")
    bie.export(_Wrap(_inplace_last), torch.randn(2, 1, 28, 28), tmp_path / "m.safetensors")
    assert [e["type"] for e in json.loads(_architecture(tmp_path / "m.safetensors"))] == [
        "relu", "add", "flatten"]


def test_load_refuses_what_is_not_a_bie_model(residual, tmp_path):
    _, path = residual
    tensors, meta = read_safetensors(path)
    ordered = [(name, dtype, t) for name, (dtype, t) in tensors.items()]
    bad = tmp_path / "bad.safetensors"
    write_safetensors(bad, ordered, dict(meta, format="other"))
    with pytest.raises(bie.BieError, match="not a bie model file"):
        bie.load(bad)
    write_safetensors(bad, [e for e in ordered if e[0] != "3.scale_w"], meta)
    with pytest.raises(bie.BieError, match="tensor '3.scale_w' is missing"):
        bie.load(bad)
    write_safetensors(bad, ordered + [("99.weight", "F32", torch.ones(1))], meta)
    with pytest.raises(bie.BieError, match="unexpected tensor '99.weight'"):
        bie.load(bad)


# ---------------------------------------------------------------------- the bie command


def test_bie_command_predicts_what_torch_does(residual, cli, tmp_path):
    model, path = residual
    count = 300
    with torch.no_grad():
        want = model(_test_images(count, 100))
    got = _logits(cli, path, count, 100)
    # bie's float layers (BLAS convs, batch norm) round differently from torch's: the scores
    # agree to float rounding, the classes exactly.
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.equal(got.argmax(1), want.argmax(1))
    assert "test accuracy" in _run(cli, "eval", path, "--limit", 500, "--threads", 2)
    # Packing with `bie export` keeps the scores bit for bit, in C and through bie.load.
    packed = tmp_path / "packed.safetensors"
    assert "smaller than float32" in _run(cli, "export", path, packed)
    assert torch.equal(_logits(cli, packed, count, 100), got)
    loaded = bie.load(packed)
    assert loaded.packed and loaded.state_dict()["3.qweight"].dtype == torch.uint8
    x = _test_images(32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def _check_command_runs(model, cli, path):
    """The exported model through `bie predict --logits` against the module on 200 images."""
    bie.export(model, torch.randn(2, 1, 28, 28), path)
    with torch.no_grad():
        want = model(_test_images(200))
    got = _logits(cli, path, 200)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.99


def test_bie_command_runs_the_other_layers(cli, tmp_path):
    torch.manual_seed(11)
    _check_command_runs(_train(Mixed()), cli, tmp_path / "mixed.safetensors")


def test_bie_command_runs_batch_norm_act(cli, tmp_path):
    _check_command_runs(_norm_act_model(17), cli, tmp_path / "norm_act.safetensors")


@pytest.mark.parametrize("preset", [["--model", "resnet", "--width", "4", "--depth", "1"],
                                    ["--model", "cnn", "--width", "4", "--first-last", "q4"]],
                         ids=["resnet", "cnn-q4"])
def test_load_reads_files_bie_train_writes(preset, cli, tmp_path):
    _run(cli, "train", *preset, "--epochs", 1, "--train-limit", 256, "--test-limit", 100,
         "--threads", 2, "--progress", "none", "--out", tmp_path)
    path = tmp_path / "model.safetensors"
    loaded = bie.load(path)
    with torch.no_grad():
        want = loaded(_test_images(100))
    got = _logits(cli, path, 100)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # The packed export loads too and computes the same scores bit for bit.
    _run(cli, "export", path, tmp_path / "packed.safetensors")
    with torch.no_grad():
        assert torch.equal(bie.load(tmp_path / "packed.safetensors")(_test_images(100)), want)
    # The stdlib writer lays a file out as bie's writer does, byte for byte.
    tensors, meta = read_safetensors(path)
    write_safetensors(tmp_path / "copy.safetensors",
                      [(name, dtype, t) for name, (dtype, t) in tensors.items()], meta)
    assert (tmp_path / "copy.safetensors").read_bytes() == path.read_bytes()
    # Exporting the loaded module writes the architecture `bie train` wrote, byte for byte.
    bie.export(loaded, torch.zeros(1, 1, 28, 28), tmp_path / "again.safetensors")
    assert _architecture(tmp_path / "again.safetensors") == meta["architecture"]


def test_export_example_runs(tmp_path, monkeypatch):
    """README.md's "Train in PyTorch, deploy with `bie eval`": the Python block as written, then its shell lines with this
    checkout's bie command (when it and the data set are there)."""
    text = EXAMPLE.read_text().split("### Train in PyTorch, deploy with `bie eval`", 1)[1]
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(EXAMPLE), "exec"), {"__name__": "__example__"})
    assert bie.load("model.safetensors").classes[0] == "T-shirt/top"
    try:
        command = _usable_cli()
    except pytest.skip.Exception:
        return
    for line in re.findall(r"```sh\n(.*?)```", text, re.S)[0].splitlines():
        args = line.split("#")[0].split()
        assert args[0] == "bie"
        _run(command, *args[1:])
    assert (tmp_path / "model-packed.safetensors").is_file()
