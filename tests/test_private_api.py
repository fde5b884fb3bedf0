"""Private torch APIs are used only inside ``autopar/_torch_compat/`` (the house rule: a torch
upgrade is fixed in one package). An AST walk over every other ``autopar/**/*.py`` flags:

- an import of a torch module or name with a component starting with ``_``
  (``import torch._dynamo``, ``from torch.utils import _pytree``, ``from torch.x import _f``);
- a dotted chain rooted at ``torch`` (through import aliases and ``x = torch...`` assignments)
  with such a component (``torch._C``, ``torch.ops._c10d_functional``, ``c10d._resolve_process_group``
  after ``import torch.distributed.distributed_c10d as c10d``). Operator names under
  ``torch.ops.<namespace>.`` are not attributes of torch's Python API but names of the dispatcher's
  registry (``torch.ops.aten._to_copy``, the ops captured graphs contain): only the namespace is checked;
- a string that is a private torch module path (``"torch._dynamo"``, for ``importlib``);
- attribute access (also through ``getattr``/``hasattr``/``setattr``/``delattr`` with a constant
  name) to one of ``TORCH_PRIVATE_ATTRS``, private attributes of torch objects, and the definition
  of a method named in ``TORCH_PRIVATE_METHODS`` (an override of a private ``nn.Module`` hook);
- a call of a constructor torch documents as private (``DTensor(local, spec, ...)``).
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"
COMPAT = PACKAGE / "_torch_compat"

#: Private attributes of torch objects, matched on any object (the checker does not know types).
#: Chosen from what autopar has used (``git grep``) and its close neighbours; none of them is a
#: name autopar gives its own attributes (``_name``, ``_op``, ``_grad``, ``_local_shape`` are
#: autopar's and so are left out).
TORCH_PRIVATE_ATTRS = frozenset({
    # DTensor
    "_local_tensor", "_spec",
    # nn.Module state tables and hooks
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_hooks",
    "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_load_state_dict_pre_hooks", "_apply", "_call_impl",
    # Tensor internals
    "_post_accumulate_grad_hooks", "_cdata", "_version", "_base", "_grad_fn", "_typed_storage",
    # OpOverload / OpOverloadPacket
    "_opname", "_schema", "_overloadpacket", "_overloadname",
    # fx
    "_codegen", "_input_nodes", "_erased", "_rename", "_graph_namespace",
})

#: Private ``nn.Module`` methods that torch calls itself: overriding one depends on torch's internals.
TORCH_PRIVATE_METHODS = frozenset({"_apply", "_call_impl", "_load_from_state_dict", "_save_to_state_dict"})

#: Constructors torch documents as private (DTensor: build one with ``from_local``).
PRIVATE_CONSTRUCTORS = frozenset({"torch.distributed.tensor.DTensor", "torch.distributed.tensor._api.DTensor"})

_ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}
_MODULE_PATH = re.compile(r"torch(\.[A-Za-z_]\w*)+")


def _private_parts(dotted: str) -> list[str]:
    """The components of a torch dotted name that start with ``_`` (op names under ``torch.ops.ns``
    excepted: see the module docstring)."""
    parts = dotted.split(".")
    if parts[:2] == ["torch", "ops"]:
        parts = parts[:3]
    return [p for p in parts if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``node``'s full dotted name when it is a chain of attributes on a torch-rooted name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(attrs)])


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch modules or objects: imports, and ``x = torch.a.b`` assignments."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        out[a.name.split(".")[0]] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    changed = True
    while changed:  # assignments may chain (aten = torch.ops.aten; mm = aten.mm)
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                d = _dotted(node.value, out)
                if d is not None and out.get(node.targets[0].id) != d:
                    out[node.targets[0].id] = d
                    changed = True
    return out


def violations(source: str, filename: str = "<string>") -> list[str]:
    """Every private torch use in ``source``, as ``filename:line: what``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch" and _private_parts(a.name):
                    found.append((line, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            bad = [a.name for a in node.names if a.name.startswith("_")]
            if _private_parts(node.module) or bad:
                found.append((line, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Attribute):
            if node.attr in TORCH_PRIVATE_ATTRS:
                found.append((line, f"attribute .{node.attr} ({ast.unparse(node)})"))
            elif id(node) not in inner:
                d = _dotted(node, aliases)
                if d is not None and d.split(".")[0] == "torch" and _private_parts(d):
                    found.append((line, f"{ast.unparse(node)} ({d})"))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in _ATTR_FUNCS and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in TORCH_PRIVATE_ATTRS:
                found.append((line, f"{f.id}(..., {node.args[1].value!r})"))
            name = _dotted(f, aliases) if isinstance(f, ast.Attribute) else aliases.get(getattr(f, "id", ""))
            if name in PRIVATE_CONSTRUCTORS:
                found.append((line, f"private constructor {ast.unparse(f)}(...) ({name})"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in aliases:
            d = aliases[node.id]
            if d.split(".")[0] == "torch" and _private_parts(d):
                found.append((line, f"{node.id} ({d})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_PATH.fullmatch(node.value) \
                and _private_parts(node.value):
            found.append((line, f"module path {node.value!r}"))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in TORCH_PRIVATE_METHODS:
                    found.append((item.lineno, f"override of torch's private method {node.name}.{item.name}"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def _files() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if COMPAT not in p.parents)


def test_no_private_torch_api_outside_torch_compat():
    assert COMPAT.is_dir(), "autopar/_torch_compat/ is the package holding every private torch use"
    files = _files()
    assert len(files) > 20, files  # the walk really covers the package
    bad = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "private torch APIs outside autopar/_torch_compat/ (wrap them there):\n" + "\n".join(bad)


BAD_SNIPPET = '''
import torch
import torch._dynamo                                                    # BAD torch._dynamo
import torch.distributed.distributed_c10d as c10d
from torch.utils import _pytree                                         # BAD _pytree
from torch.utils._pytree import tree_map                                # BAD torch.utils._pytree
from torch.distributed import _functional_collectives as fc             # BAD _functional_collectives
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module              # BAD _reparametrize_module
import importlib

aten = torch.ops.aten
ok = aten._to_copy.default                      # an operator name: fine
ok2 = torch.ops.aten._unsafe_view.default       # fine
n = torch._C._will_engine_execute_node(node)                            # BAD torch._C._will_engine_execute_node
r = torch.ops._c10d_functional.all_reduce_                              # BAD _c10d_functional
g = c10d._resolve_process_group("0")                                    # BAD c10d._resolve_process_group
w = fc.all_reduce                                                       # BAD fc.all_reduce
y = tree_map(f, x)                                                      # BAD tree_map
s = t._spec                                                             # BAD ._spec
l = getattr(t, "_local_tensor", None)                                   # BAD '_local_tensor'
p = mod._parameters["w"]                                                # BAD ._parameters
d = DTensor(local, spec, requires_grad=False)                           # BAD private constructor DTensor
m = importlib.import_module("torch._inductor")                          # BAD 'torch._inductor'


class M(torch.nn.Module):
    def _apply(self, fn, recurse=True):                                 # BAD M._apply
        return super()._apply(fn, recurse)                              # BAD ._apply

    def _own(self):                             # autopar's own private names: fine
        return self._name, self._op, self._local_shape, torch.nn.Linear
'''


def test_checker_flags_private_uses():
    got = violations(BAD_SNIPPET, "bad.py")
    text = "\n".join(got)
    expected = {}
    for i, line in enumerate(BAD_SNIPPET.splitlines(), start=1):
        if "# BAD " in line:
            expected[i] = line.split("# BAD ")[1].strip()
    assert len(expected) == 17
    for line, needle in expected.items():  # every private use is flagged, on its own line, naming it
        assert any(v.startswith(f"bad.py:{line}: ") and needle in v for v in got), (line, needle, text)
    # and nothing else: operator names, public torch names, autopar's own private attributes
    assert {int(v.split(":")[1]) for v in got} == set(expected), text
    assert not violations("import torch\nx = torch.ops.aten._to_copy.default\nself._name = 1\n"
                          "from torch.distributed.tensor import Shard\n")


# -- the wrappers whose meaning a torch upgrade could change without an import error --------------

def test_storage_use_count_counts_the_tensors_sharing_memory():
    import torch

    from autopar import _torch_compat as tc

    t = torch.zeros(8)
    assert tc.storage_use_count(t) == 1
    view = t[2:]
    assert tc.storage_use_count(t) == 2 and tc.storage_use_count(view) == 2
    del view
    assert tc.storage_use_count(t) == 1


def test_record_dispatch_reports_each_op_once_with_its_result():
    import torch

    from autopar import _torch_compat as tc

    calls = []
    with tc.FakeTensorMode():
        x = torch.empty(2, 3)
        with tc.record_dispatch(lambda *call: calls.append(call)):
            y = torch.mm(x, x.t())
    aten = [call for call in calls if call[0].namespace == "aten"]  # the fake mode also asks prim.device
    assert [str(func) for func, *_ in aten] == ["aten.t.default", "aten.mm.default"], calls
    _, args, kwargs, out = aten[-1]
    assert out is y and isinstance(y, tc.FakeTensor) and args[0] is x and kwargs == {}


def test_fast_joint_fallback_is_logged_with_its_reason(caplog):
    import logging

    import torch

    from autopar import _torch_compat as tc
    from autopar.ir.capture import capture

    class Norm(torch.nn.Module):  # batch norm updates its running stats: a mutation, not the fast path
        def __init__(self):
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.lin(x)).sum()

    before = dict(tc.JOINT_PATHS)
    with caplog.at_level(logging.DEBUG, logger="autopar._torch_compat.aot"):
        capture(Norm(), (torch.randn(3, 4),))
    assert tc.JOINT_PATHS["aot"] == before["aot"] + 1 and tc.JOINT_PATHS["fast"] == before["fast"]
    why = [r.getMessage() for r in caplog.records if r.name == "autopar._torch_compat.aot"]
    assert any("fell back" in m and "Norm" in m and "_NotFast" in m for m in why), why
