"""User names for what a plan's reshardings and ops name internally (captured graph node names such as
``primals_12`` or ``t_2``), for the views: an op is ``module path: op`` (``blocks.0.mlp.fc: t``, with
``(backward)`` for a backward op), as ``ir.graph.Node.where`` names it; a parameter or input is its FQN,
``input:N`` or keyword name.

A plan names a parameter's or input's tensor by its node only, so the name is found from what the plan
records of it: its placement (a resharding's ``from``), its bytes (the resharding's ``bytes``, its
element count times 1, 2, 4 or 8) and the module that reads it. When several parameters fit alike (a
layer norm's weight and bias), every one is named ("blocks.0.ln_1.bias or blocks.0.ln_1.weight"), so
a name shown is never a guess.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from autopar.plans.schema import Plan

_SHAPE = re.compile(r"\[([0-9, ]*)\]\s*$")
#: element sizes a moved tensor may have (its dtype, or the one a precision casts it to)
_ELEMENT_BYTES = (1, 2, 4, 8)
#: at most this many candidates are named
_SHOWN = 3


def _numel(spec: str) -> Optional[int]:
    """``"float32[128, 64]"`` -> 8192 (None when the text is not a shape)."""
    m = _SHAPE.search(str(spec))
    if m is None:
        return None
    dims = [d for d in m.group(1).replace(" ", "").split(",") if d]
    return math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else None


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    op = op[len("aten."):] if op.startswith("aten.") else op
    return op[:-len(".default")] if op.endswith(".default") else op


def op_label(node: dict) -> str:
    """A plan's node entry as users know the op: ``module path: op``, ``(backward)`` for a backward op."""
    text = f"{node.get('module') or '<root>'}: {_short_op(str(node.get('op', '?')))}"
    return text + " (backward)" if node.get("phase") == "backward" else text


def _join(names: list[str]) -> str:
    shown = names[:_SHOWN]
    more = f" (or {len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return " or ".join(shown) + more


def namer(plan: "Plan") -> Callable[[Optional[str], Optional[dict]], str]:
    """``name(tensor, resharding)``: the user's name of a plan's tensor or consumer name (a node name, with
    ``[i]`` for output i), read with the resharding entry it comes from (None for an op's own name)."""
    nodes = {n.get("name"): n for n in plan.nodes if isinstance(n, dict)}
    shapes = dict(plan.graph.get("shapes") or {})
    fqns = set(shapes) | set(plan.graph.get("fqns") or ())
    inputs = dict(plan.graph.get("inputs") or {})

    def fits(spec: Optional[str], nbytes) -> bool:
        n = _numel(spec) if spec is not None else None
        return n is None or not isinstance(nbytes, int) or any(n * eb == nbytes for eb in _ELEMENT_BYTES)

    def placeholder(r: dict) -> str:
        if r.get("kind") == "param":
            pool, what = sorted(fqns), "a parameter"
            spec = shapes.get
        else:
            pool, what = sorted(inputs), "an input of the model"
            spec = inputs.get
        found = [k for k in pool if plan.placements.get(k) == r.get("from") and fits(spec(k), r.get("bytes"))]
        module = r.get("module") or ""
        near = [k for k in found if k.startswith(module + ".")] if module else []
        if found:  # the module's own first
            return _join(near + [k for k in found if k not in near])
        return f"{what} read by {module}" if module else what

    def name(tensor: Optional[str], r: Optional[dict] = None) -> str:
        text = str(tensor)
        if text.startswith("param:") or text == "loss":  # a gradient's destination, the loss's sink
            return f"the parameter {text[6:]}" if text.startswith("param:") else "the loss"
        consumer = str((r or {}).get("consumer", ""))
        if r is not None and r.get("kind") == "grad" and consumer.startswith("param:"):
            return f"the gradient of {consumer[6:]}"
        base, _, index = text.partition("[")
        node = nodes.get(base)
        if node is not None and r is not None and r.get("kind") == "param":  # a view of a parameter (its transpose)
            module = node.get("module") or ""
            found = [k for k in sorted(fqns) if k.rpartition(".")[0] == module and fits(shapes.get(k), r.get("bytes"))]
            if found:
                return f"{_join(found)} (as {_short_op(str(node.get('op', '?')))})"
        if node is not None:
            return op_label(node) + (f" output {index.rstrip(']')}" if index and index != "0]" else "")
        if text in fqns or text in inputs:
            return text
        return placeholder(r) if r is not None else text

    return name


def alternative_label(plan: "Plan", text: str) -> str:
    """An alternative's name, ``"<node> (<op>) as <strategies>"``, with the op named as users know it."""
    nodes = {n.get("name"): n for n in plan.nodes if isinstance(n, dict)}
    head, sep, rest = str(text).partition(" as ")
    node = nodes.get(head.split(" ", 1)[0])
    return f"{op_label(node)} as {rest}" if node is not None and sep else str(text)


__all__ = ["alternative_label", "namer", "op_label"]
