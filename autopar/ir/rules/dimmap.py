"""Dimension maps: the data an op's sharding rule is made of.

A ``DimMap`` names the *factors* of one op instance (einsum-style) and says, for every tensor dim of
every input and output, which factors it is made of. From it the one-axis signatures follow:

- split a factor: every tensor that has it is ``S(dim)``, the others ``B``; an output that lacks it
  is ``P`` when the factor is a reduction of that kind (``m k, k n -> m n`` split on ``k``), and the
  split is invalid otherwise (a normalised dim, a softmax dim);
- partial propagation: the op is linear in some group of inputs, so ``P`` there (``B`` elsewhere)
  gives ``P`` outputs (``add``: both addends; ``mul``: either factor; ``addmm``: bias with either
  matrix);
- everything ``B``.

Merged dims (a view from ``(h, d)`` to ``h*d``) list several factors; only the leading one may be
split, and only when the split divides it exactly, else the pieces of the merged dim and of the
separate dim would not line up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from autopar.ir.placement import B, Balanced, Partial, Placement, Split

Dims = list[tuple[str, ...]]  # per tensor dim, the factors it is made of ( () for a broadcast size-1 dim)


@dataclass(frozen=True)
class Signature:
    """How one op instance can run on one mesh axis: a placement per tensor input and per output.

    ``tag`` names the choice (``"B"``, ``"S:k"``, ``"P:0"``, or a special rule's name) so that a
    rank-aware local implementation can tell which factor an axis splits. ``outputs`` has ``None``
    for a non-tensor output.
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Optional[Placement], ...]
    tag: str = "B"

    def __str__(self) -> str:
        ins = ", ".join(str(p) for p in self.inputs)
        outs = ", ".join("-" if p is None else str(p) for p in self.outputs)
        return f"({ins}) -> ({outs})"


#: One Signature per mesh axis: a strategy for one op on an N-D mesh.
Strategy = tuple[Signature, ...]


@dataclass(frozen=True)
class Linear:
    """The op is linear (in ``kind``) in the inputs ``inputs`` taken together: ``P`` there and ``B``
    on the other inputs gives ``P`` on ``outputs`` (``B`` on the other outputs)."""

    inputs: frozenset[int]
    outputs: frozenset[int]
    kind: str = "sum"


@dataclass
class DimMap:
    """The factors of one op instance and where they sit in each tensor."""

    inputs: list[Optional[Dims]]  # per tensor input (None: a tensor the op reads whole, e.g. an index)
    outputs: list[Optional[Dims]]  # per output (None: not a tensor)
    sizes: dict[str, int]
    reduce: dict[str, str] = field(default_factory=dict)  # factor -> "sum"/"max"/"min"
    additive: frozenset[int] = frozenset()  # inputs added after the reduction (a bias): P on a reduce split
    linear: list[Linear] = field(default_factory=list)
    no_split: frozenset[str] = frozenset()
    float_inputs: tuple[bool, ...] = ()  # which inputs may be P (floating dtype)
    float_outputs: tuple[bool, ...] = ()
    # per input / output, ``{dim: blocks}`` of its dims of equal blocks (``TensorSpec.blocks``)
    in_blocks: list[dict[int, int]] = field(default_factory=list)
    out_blocks: list[dict[int, int]] = field(default_factory=list)

    def factors(self) -> list[str]:
        """Factors in first-seen order (deterministic)."""
        seen: dict[str, None] = {}
        for dims in list(self.outputs) + list(self.inputs):
            for d in dims or []:
                for f in d:
                    seen.setdefault(f, None)
        return list(seen)

    def merged(self, factor: str) -> bool:
        """True when ``factor`` shares a tensor dim with another non-trivial factor somewhere."""
        for dims in list(self.inputs) + list(self.outputs):
            for d in dims or []:
                if factor in d and sum(1 for f in d if self.sizes[f] != 1) > 1:
                    return True
        return False


def _dim_of(dims: Dims, factor: str, sizes: dict[str, int], blocks: Optional[dict[int, int]] = None
            ) -> tuple[Optional[int], int]:
    """``(dim, e)``: the tensor dim holding ``factor`` and how many equal blocks ``factor`` itself
    is cut into there; dim -1 where a split of ``factor`` is not a split of that dim.

    A plain dim may split only its leading factor (trivial factors skipped). A dim of ``c`` blocks
    (``TensorSpec.blocks``) is split block by block: the factors before ``factor`` must multiply to
    ``p`` dividing ``c``, and ``factor`` is then itself ``e = c / p`` blocks (``e = 1``: the blocks
    are exactly the factors before it, as in ``split``'s input; ``e = c``: a leading factor)."""
    for d, fs in enumerate(dims):
        if factor in fs:
            lead = [f for f in fs if sizes[f] != 1]
            if factor not in lead:
                return -1, 1
            p = 1
            for f in lead[:lead.index(factor)]:
                p *= sizes[f]
            c = (blocks or {}).get(d, 1)
            return (d, c // p) if c % p == 0 else (-1, 1)
    return None, 1


def _nth(blocks_list: list[dict[int, int]], i: int) -> Optional[dict[int, int]]:
    return blocks_list[i] if i < len(blocks_list) else None


def factor_blocks(dm: DimMap, factor: str) -> Optional[int]:
    """How many equal blocks every tensor holding ``factor`` agrees it is cut into (1: plain), or
    None where a split of ``factor`` is not valid (a dim behind another factor, or tensors that
    disagree on the blocks: one device would hold pieces of q, k and v, another whole heads)."""
    seen: set[int] = set()
    for dims_list, blocks_list in ((dm.inputs, dm.in_blocks), (dm.outputs, dm.out_blocks)):
        for i, dims in enumerate(dims_list):
            if dims is None:
                continue
            d, e = _dim_of(dims, factor, dm.sizes, _nth(blocks_list, i))
            if d == -1:
                return None
            if d is not None:
                seen.add(e)
    return seen.pop() if len(seen) == 1 else (1 if not seen else None)


def split_signature(dm: DimMap, factor: str) -> Optional[Signature]:
    """The one-axis signature that splits ``factor``, or None where that split is not valid."""
    if factor in dm.no_split or factor_blocks(dm, factor) is None:
        return None
    ins: list[Placement] = []
    for i, dims in enumerate(dm.inputs):
        d = None if dims is None else _dim_of(dims, factor, dm.sizes, _nth(dm.in_blocks, i))[0]
        if d is not None:
            ins.append(Split(d))
        elif i in dm.additive and factor in dm.reduce:
            ins.append(Partial(dm.reduce[factor]))
        else:
            ins.append(B)
    outs: list[Optional[Placement]] = []
    for j, dims in enumerate(dm.outputs):
        if dims is None:
            outs.append(None)
            continue
        d = _dim_of(dims, factor, dm.sizes, _nth(dm.out_blocks, j))[0]
        if d is not None:
            outs.append(Split(d))
        elif factor in dm.reduce and (not dm.float_outputs or dm.float_outputs[j]):
            outs.append(Partial(dm.reduce[factor]))
        else:
            return None
    if all(not isinstance(p, Split) for p in ins + [o for o in outs if o is not None]):
        return None  # the factor is nowhere a real dim
    return Signature(tuple(ins), tuple(outs), f"S:{factor}")


def linear_signature(dm: DimMap, lin: Linear, tag: str) -> Optional[Signature]:
    """The signature taking ``P`` in ``lin.inputs`` to ``P`` in ``lin.outputs``."""
    if dm.float_inputs and not all(dm.float_inputs[i] for i in lin.inputs):
        return None
    if dm.float_outputs and not all(dm.float_outputs[j] for j in lin.outputs if j < len(dm.float_outputs)):
        return None  # a partial sum cast to integers (``.long()``) is not the cast of the sum
    ins = tuple(Partial(lin.kind) if i in lin.inputs else B for i in range(len(dm.inputs)))
    outs = tuple(
        None if dims is None else (Partial(lin.kind) if j in lin.outputs else B) for j, dims in enumerate(dm.outputs)
    )
    return Signature(ins, outs, tag)


def replicate_signature(n_inputs: int, outputs: Sequence[Optional[object]]) -> Signature:
    """The signature that keeps every tensor of the call whole on one mesh axis."""
    return Signature(tuple(B for _ in range(n_inputs)), tuple(None if o is None else B for o in outputs), "B")


def enumerate_signatures(dm: DimMap, min_size: int = 2) -> list[Signature]:
    """Every one-axis signature of the op: all-B, one per splittable factor, one per linear group.

    Factors smaller than ``min_size`` are not split (a split of a size-1 dim leaves every device but
    one empty and never pays).
    """
    out = [replicate_signature(len(dm.inputs), dm.outputs)]
    for f in dm.factors():
        if dm.sizes[f] < min_size:
            continue
        sig = split_signature(dm, f)
        if sig is not None:
            out.append(sig)
    for k, lin in enumerate(dm.linear):
        sig = linear_signature(dm, lin, f"P:{','.join(map(str, sorted(lin.inputs)))}")
        if sig is not None:
            out.append(sig)
    return _dedup(out)


BALANCED_TAG = "Z:"


def balanced_signatures(dm: DimMap, sigs: Sequence[Signature], lengths: Sequence[int]) -> list[Signature]:
    """The load-balanced variant (``Z`` for ``S``, tag ``Z:<factor>``) of each split signature whose
    factor is as long as one of ``lengths`` (the causal sequences that a balanced ring attention
    of the graph splits), on a plain dim of every tensor that has it. Only for ops whose local code
    is the op itself on its blocks, which then sees positions along the factor only through its
    inputs: a split valid on contiguous blocks of any size is valid on any reordering of them."""
    out = []
    for sig in sigs:
        if not sig.tag.startswith("S:") or dm.sizes.get(sig.tag[2:]) not in lengths:
            continue
        f = sig.tag[2:]
        if dm.merged(f) or factor_blocks(dm, f) != 1:
            continue
        out.append(Signature(tuple(_balanced(p) for p in sig.inputs), tuple(_balanced(p) for p in sig.outputs),
                             BALANCED_TAG + f))
    return out


def _balanced(p: Optional[Placement]) -> Optional[Placement]:
    return Balanced(p.dim) if isinstance(p, Split) else p


def balanced_compose_ok(dm: DimMap, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """A balanced split of a factor holds only on its axis alone (no other axis splits the factor)
    and where the factor divides into ``2n`` equal chunks."""
    for a, sig in enumerate(strategy):
        if sig.tag.startswith(BALANCED_TAG):
            f = sig.tag[len(BALANCED_TAG):]
            if dm.sizes[f] % (2 * mesh_shape[a]):
                return False
            if any(s.tag[2:] == f for b, s in enumerate(strategy) if b != a and s.tag[:2] in ("S:", BALANCED_TAG)):
                return False
    return True


def _dedup(sigs: list[Signature]) -> list[Signature]:
    seen, out = set(), []
    for s in sigs:
        key = (s.inputs, s.outputs)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def compose_ok(dm: DimMap, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Whether per-axis signatures compose on an N-D mesh: a split of a factor inside a merged dim
    must divide the factor exactly by the number of pieces all axes together cut it into."""
    pieces: dict[str, int] = {}
    for sig, n in zip(strategy, mesh_shape):
        if sig.tag.startswith("S:"):
            f = sig.tag[2:]
            pieces[f] = pieces.get(f, 1) * n
    for f, n in pieces.items():
        if f in dm.sizes and dm.merged(f) and dm.sizes[f] % n != 0:
            return False
        e = factor_blocks(dm, f) if f in dm.sizes else 1
        if e and e > 1 and dm.sizes[f] % (e * n) != 0:  # every block cut into equal pieces
            return False
    return True


# ---------------------------------------------------------------------------------------------
# The einsum-like notation: "m k, k n -> m n"; "(h d)" a merged dim; "1" a size-1 dim; "_" a dim
# that must stay whole (given a unique factor that is never split).


def parse_spec(spec: str) -> tuple[list[list[tuple[str, ...]]], list[list[tuple[str, ...]]]]:
    """Parse the einsum-like rule notation (``"m k, k n -> m n"``; ``(h d)`` a merged dim, ``1``
    a size-1 dim, ``_`` a dim that stays whole) into per-tensor lists of dims, each a tuple of factors."""
    lhs, _, rhs = spec.partition("->")

    def tensors(side: str) -> list[list[tuple[str, ...]]]:
        out = []
        for t in side.split(","):
            dims: list[tuple[str, ...]] = []
            toks = t.replace("(", " ( ").replace(")", " ) ").split()
            group: Optional[list[str]] = None
            for tok in toks:
                if tok == "(":
                    group = []
                elif tok == ")":
                    assert group is not None
                    dims.append(tuple(group))
                    group = None
                elif group is not None:
                    group.append(tok)
                else:
                    dims.append(() if tok == "1" else (tok,))
            out.append(dims)
        return out

    return tensors(lhs), tensors(rhs) if rhs.strip() else []


def from_spec(
    spec: str,
    in_shapes: Sequence[Optional[Sequence[int]]],
    out_shapes: Sequence[Optional[Sequence[int]]],
    **kw,
) -> DimMap:
    """Build a DimMap from notation and the concrete shapes (which give every factor its size).

    Each ``_`` becomes a fresh factor that is never split. A merged dim's factor sizes must be
    known from another tensor.
    """
    ins, outs = parse_spec(spec)
    counter = [0]

    def fresh(dims):
        res = []
        for d in dims:
            new = []
            for f in d:
                if f == "_":
                    counter[0] += 1
                    f = f"_{counter[0]}"
                new.append(f)
            res.append(tuple(new))
        return res

    ins = [fresh(d) for d in ins]
    outs = [fresh(d) for d in outs]
    sizes: dict[str, int] = {}
    for dims_list, shapes in ((ins, in_shapes), (outs, out_shapes)):
        for dims, shape in zip(dims_list, shapes):
            if shape is None:
                continue
            assert len(dims) == len(shape), f"spec {spec!r} does not match shape {tuple(shape)}"
            for fs, size in zip(dims, shape):
                if len(fs) == 1:
                    sizes.setdefault(fs[0], size)
    for dims_list in (ins, outs):
        for dims in dims_list:
            for fs in dims:
                for f in fs:
                    sizes.setdefault(f, 1)
    no_split = frozenset(f for f in sizes if f.startswith("_")) | frozenset(kw.pop("no_split", ()))
    return DimMap(
        inputs=[d if s is not None else None for d, s in zip(ins, in_shapes)],
        outputs=[d if s is not None else None for d, s in zip(outs, out_shapes)],
        sizes=sizes,
        no_split=no_split,
        **kw,
    )
