"""The Fashion-MNIST example keeps working: its data reader and model, on a few images."""

import pathlib

import pytest
import torch

import bie
from scripts import load_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_fashion_mnist.py"


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE)


def test_model_trains_a_step_on_the_dataset(example):
    if not (example.DATA / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("dataset-fashion-mnist is not installed")
    x, y = example.load("test", 64)
    assert x.shape == (64, 1, 28, 28) and y.shape == (64,) and 0 <= int(y.min())
    assert int(y.max()) <= 9 and abs(float(x.mean())) < 0.5  # normalised
    model = example.binary_cnn(width=4, dense=16)
    bie.prepare_bie_layers(model)
    optimizer = bie.SignFlip(model.parameters(), float_lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert all(0 < v < 10 for v in losses)
    assert 0.0 <= example.evaluate(model, x, y, 32) <= 1.0


def test_main_trains_an_epoch_channels_last(example, capsys):
    if not (example.DATA / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("dataset-fashion-mnist is not installed")
    example.main(["--limit", "128", "--batch-size", "64", "--width", "4", "--channels-last",
                  "--binary-lr", "0.1"])
    out = capsys.readouterr().out
    assert "channels-last, exact backward" in out
    accuracy = float(out.split("test accuracy ")[1].split("%")[0])
    assert 0.0 <= accuracy <= 100.0


def test_channels_last_model_keeps_nhwc_after_the_4bit_conv(example):
    model = example.binary_cnn(width=4, dense=16, channels_last=True)
    x = torch.randn(2, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    h = model[1](model[0](x))  # the 4-bit conv, then the conversion
    assert h.is_contiguous(memory_format=torch.channels_last) and h.shape == (2, 4, 28, 28)


@pytest.mark.parametrize("flags", [["--bf16"], ["--backward", "fp8"]])
def test_gpu_only_options_need_cuda(example, flags):
    with pytest.raises(SystemExit) as stop:
        example.main(["--device", "cpu", *flags])
    assert stop.value.code == 2  # argparse's usage error, before any data is read
