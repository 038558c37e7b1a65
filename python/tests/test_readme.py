"""The Python examples of the READMEs run as written (in a scratch folder, on the CPU)."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _examples():
    blocks = []
    for readme in (REPO / "README.md", REPO / "python" / "README.md"):
        text = readme.read_text()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            blocks.append(pytest.param(block, id=f"{readme.parent.name}-{i}"))
    return blocks


@pytest.mark.parametrize("code", _examples())
def test_readme_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README example", "exec"), {"__name__": "__readme__"})


def test_readmes_have_python_examples():
    assert len(_examples()) >= 2
