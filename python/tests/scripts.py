"""Loads a script of this checkout (an example, a benchmark) as a module, for the tests that
call its functions."""

import importlib.util


def load_script(path):
    """The module of the Python file at path, named after it, executed once."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
