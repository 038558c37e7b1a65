"""The Fashion-MNIST example keeps working: its data reader and model, on a few images."""

import importlib.util
import pathlib

import pytest
import torch

import bie

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_fashion_mnist.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_fashion_mnist", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
