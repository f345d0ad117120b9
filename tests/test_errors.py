"""Every error forebay raises on purpose derives from ForebayError (and the builtin a
caller expects: ValueError, TypeError, KeyError...)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import forebay
from forebay import errors

SRC = Path(forebay.__file__).parent
BUILTIN_ERRORS = {n for n in dir(builtins)
                  if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)}


def test_no_bare_builtin_raises_in_the_package():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        # a module's __getattr__ must raise AttributeError itself (Python's protocol)
        protocol = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                    and f.name == "__getattr__" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    isinstance(node.exc.func, ast.Name) and node.exc.func.id in BUILTIN_ERRORS \
                    and not (id(node) in protocol and node.exc.func.id == "AttributeError"):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.exc.func.id}")
    assert bad == [], "raise a forebay.errors class instead:\n" + "\n".join(bad)


def test_every_error_class_is_a_forebay_error_and_its_builtin():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ForebayError), name
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.ArgumentTypeError, TypeError)
    assert issubclass(errors.NameNotFoundError, KeyError)
    assert issubclass(errors.DatasetNotFoundError, FileNotFoundError)
    assert issubclass(errors.CorruptDatasetError, ValueError)
