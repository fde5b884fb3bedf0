"""The forms an ``autopar::attention`` op runs in on one mesh axis, named for the user.

An attention op's strategy splits, on each mesh axis, one dim of its queries: the batch, the heads
or the query sequence. Whether a head split is tensor parallelism or all-to-all (Ulysses) context
parallelism depends on how the queries, keys and values arrive: sequence-split activations
resharded to heads (an all-to-all each way) is Ulysses. A form is therefore a condition on the
op's own signature (its tag, the dim it splits the queries on) and, for some, on the placement its
q, k and v arrive in. ``FORMS`` is the one table: the ``attention=`` keyword of ``autopar.plan``
forces forms (``passes.search.forms``), and ``plan.explain`` names them (``plans.view``). A new
form (a strategy of its own, e.g. ring attention's signatures, recognised by their tag) is one
entry here.

The ``attention=`` value: ``{axis: form}`` for every attention op, or ``{module glob: {axis: form}}``
for the ops under matching module paths (``"layers.*.attn"``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from autopar.errors import ArgumentError
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.placement import Placement, Split

__all__ = ["FORMS", "Form", "check_forms", "classify", "forms_for", "is_attention", "matches", "q_index", "qkv_indices"]

#: the dims of attention's ``[batch, heads, sequence, head_dim]`` operands
BATCH, HEADS, SEQ = 0, 1, 2


@dataclass(frozen=True)
class Form:
    """One way an attention op runs on one mesh axis.

    ``q_dim``: the dim of q the op's signature splits (None: any); ``tag``: the signature's tag
    (a strategy of its own; None: a plain split, whose tag no other form claims); ``arrives``: the
    dim q, k and v must be split on where they are produced (None: wherever the search puts them).
    """

    what: str
    q_dim: Optional[int] = None
    tag: Optional[str] = None
    arrives: Optional[int] = None


#: form name -> Form; ``classify`` tries the forms with a tag first, then the rest in this order
#: (so "ulysses", which also needs its operands to arrive sequence-split, before "heads")
FORMS: dict[str, Form] = {
    "batch": Form("batch split: each device attends its own sequences", q_dim=BATCH),
    "ulysses": Form("all-to-all (Ulysses): sequence-split q/k/v become head-split for the attention and back",
                    q_dim=HEADS, arrives=SEQ),
    "heads": Form("head split: each device attends its own heads", q_dim=HEADS),
    "gather": Form("query split with the keys and values all-gathered", q_dim=SEQ),
    "ring": Form("ring: q, k, v sequence-split, the key/value blocks passed around the axis", q_dim=SEQ, tag="ring"),
    "ring:balanced": Form("load-balanced ring: as ring, each device holding a front block and its mirror so "
                          "causal work is even", q_dim=SEQ, tag="ring:balanced"),
}


def q_index(op: str) -> int:
    """The input index of q in an attention op's signature (the backward takes the gradient first)."""
    return 1 if op == ATTN_BWD else 0


def qkv_indices(op: str) -> tuple[int, int, int]:
    """The input indices of q, k and v of an attention op."""
    i = q_index(op)
    return i, i + 1, i + 2


def _tagged() -> set[str]:
    return {f.tag for f in FORMS.values() if f.tag is not None}


def matches(form: Form, tag: str, q_read: Placement, arrived: Optional[Placement]) -> bool:
    """Whether an attention signature (``tag``, q read ``q_read``) whose q was produced ``arrived``
    (None: not known, e.g. the backward's) is in ``form`` on its axis."""
    if form.tag is not None:
        return tag == form.tag
    if tag in _tagged():
        return False
    if form.q_dim is not None and not (isinstance(q_read, Split) and q_read.dim == form.q_dim):
        return False
    if form.arrives is not None and arrived is not None:
        return isinstance(arrived, Split) and arrived.dim == form.arrives
    return True


def classify(tag: str, q_read: Placement, arrived: Optional[Placement]) -> Optional[str]:
    """The form's name for one axis of an attention op's strategy; None where the axis does not
    split it (q read whole)."""
    if tag not in _tagged() and not isinstance(q_read, Split):
        return None
    order = sorted(FORMS, key=lambda k: FORMS[k].tag is None)
    for name in order:
        form = FORMS[name]
        if form.arrives is not None and arrived is None:
            continue  # needs to know where q came from
        if matches(form, tag, q_read, arrived):
            return name
    return f"split {q_read}"


def check_forms(value: Any, axis_names: tuple[str, ...], where: str = "autopar.plan: attention") -> dict[str, dict[str, str]]:
    """``attention=`` read into ``{module glob: {axis: form}}`` (``"*"``: every op); an
    ``ArgumentError`` names the first bad key or form."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ArgumentError(f"{where} must be a dict such as {{'sp': 'ulysses'}} (mesh axis -> form) or "
                            f"{{'layers.*.attn': {{'sp': 'ulysses'}}}}, got {type(value).__name__}")
    if all(isinstance(v, str) for v in value.values()):
        value = {"*": value}
    out: dict[str, dict[str, str]] = {}
    for glob, per_axis in value.items():
        if not isinstance(glob, str) or not isinstance(per_axis, Mapping):
            raise ArgumentError(f"{where}[{glob!r}] must map mesh axis names to forms, e.g. {{'sp': 'ulysses'}}")
        for axis, form in per_axis.items():
            if axis not in axis_names:
                raise ArgumentError(f"{where}: {axis!r} is not an axis of the mesh; its axes are {list(axis_names)}")
            if form not in FORMS:
                raise ArgumentError(f"{where}: form {form!r} for axis {axis!r} is unknown; choose from {sorted(FORMS)}")
        out[glob] = dict(per_axis)
    return out


def forms_for(forms: Mapping[str, Mapping[str, str]], module_path: str) -> dict[str, str]:
    """The forms (axis -> form) asked for the attention op under ``module_path`` (later globs win)."""
    out: dict[str, str] = {}
    for glob, per_axis in forms.items():
        if glob == "*" or fnmatch.fnmatchcase(module_path, glob) or fnmatch.fnmatchcase(module_path, glob + ".*"):
            out.update(per_axis)
    return out


def is_attention(op: str) -> bool:
    """Whether ``op`` is the attention op or its backward."""
    return op in (ATTN_FWD, ATTN_BWD)
