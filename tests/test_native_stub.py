"""The type stubs (python/moelink/_native.pyi) against the compiled module: the
same public names, the same members per class, and, where the module carries a
signature, the same parameter names in the same order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from moelink import _native

STUB = Path(__file__).resolve().parents[1] / "python" / "moelink" / "_native.pyi"
TREE = ast.parse(STUB.read_text())
FUNCS = {n.name: n for n in TREE.body if isinstance(n, ast.FunctionDef)}
CLASSES = {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}
VARS = {n.target.id for n in TREE.body if isinstance(n, ast.AnnAssign)} | {
    t.id for n in TREE.body if isinstance(n, ast.Assign) for t in n.targets
    if isinstance(t, ast.Name)
}  # fmt: skip


def public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def members(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """The class's own methods and those of its private bases within the stub
    (the @type_check_only classes that gather what several native classes have)."""
    found: dict[str, ast.FunctionDef] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id.startswith("_"):
            found.update(members(CLASSES[base.id]))
    found.update({m.name: m for m in node.body if isinstance(m, ast.FunctionDef)})
    return found


def stub_params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def module_params(obj) -> list[str] | None:
    if not getattr(obj, "__text_signature__", None):
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values() if p.name not in ("self", "cls")]


def test_the_stub_names_every_public_name_of_the_module_and_no_other():
    stub = public(FUNCS) | public(CLASSES) | public(VARS)
    module = public(dir(_native))
    assert module - stub == set(), "in the module, missing from _native.pyi"
    assert stub - module == set(), "in _native.pyi, missing from the module"


@pytest.mark.parametrize("name", sorted(public(CLASSES)))
def test_class_members_match(name):
    cls = getattr(_native, name)
    module = public(dir(cls))
    if issubclass(cls, BaseException):
        module -= set(dir(cls.__mro__[1]))  # what the builtin base brings
    stub = public(members(CLASSES[name]))
    assert module == stub, f"{name}: module-only {module - stub}, stub-only {stub - module}"


def is_property(fn: ast.FunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "property")
        or (isinstance(d, ast.Attribute) and d.attr in ("setter", "getter"))
        for d in fn.decorator_list
    )


def signatures():
    """Every function and method of the stub (properties have no parameters)."""
    for name, fn in FUNCS.items():
        if not name.startswith("_"):
            yield name, getattr(_native, name, None), fn
    for cname, node in CLASSES.items():
        if cname.startswith("_"):
            continue
        cls = getattr(_native, cname)
        for mname, fn in members(node).items():
            if mname in ("__new__", "__init__"):
                yield f"{cname}()", cls, fn
            elif not mname.startswith("_") and not is_property(fn):
                yield f"{cname}.{mname}", getattr(cls, mname, None), fn


@pytest.mark.parametrize(
    "label,obj,fn", list(signatures()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_parameters_match(label, obj, fn):
    assert obj is not None, f"{label}: not in the module"
    got = module_params(obj)
    assert got is not None, f"{label}: the module carries no signature to compare"
    assert got == stub_params(fn), f"{label}: module {got}, stub {stub_params(fn)}"
