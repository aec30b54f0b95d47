"""Every error class mpistrat raises at its users lives in ``mpistrat.errors`` (one place
to find them, one module to import them from); old import paths keep working."""

from __future__ import annotations

import ast
from pathlib import Path

import mpistrat
from mpistrat import errors

PACKAGE = Path(mpistrat.__file__).parent


def test_every_mpistrat_error_class_is_defined_in_errors_py():
    names = set(errors.__all__) | {"MpistratError"}
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    (base.id if isinstance(base, ast.Name) else
                     base.attr if isinstance(base, ast.Attribute) else None) in names
                    for base in node.bases):
                outside.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    assert not outside, f"error classes outside mpistrat/errors.py: {outside}"


def test_arena_full_error_is_in_errors_and_importable_from_its_old_places():
    from mpistrat import ps
    from mpistrat.ps import store

    assert "ArenaFullError" in errors.__all__
    assert errors.ArenaFullError.__module__ == "mpistrat.errors"
    assert ps.ArenaFullError is store.ArenaFullError is errors.ArenaFullError
    assert issubclass(errors.ArenaFullError, errors.MpistratError)
    assert issubclass(errors.ArenaFullError, MemoryError)
