"""An independent oracle for the collectives a sharded program needs: XLA's SPMD partitioner.

Each named program below is written in JAX, jit-compiled on a ``jax.sharding.Mesh`` of virtual
CPU devices with explicit shardings -- inputs through ``in_shardings``, EVERY intermediate pinned
with ``jax.lax.with_sharding_constraint``, outputs through ``out_shardings`` -- and the collectives
of the optimized HLO (``jitted.lower(...).compile().as_text()``) are read back and normalised.
JAX runs in a fresh subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set
before jax is imported); all programs are compiled in one go and the result is cached in-process.

Placements use autopar's SBP vocabulary, one entry per mesh axis in mesh-axis order: ``S(d)`` split
on tensor dim ``d`` along that axis, ``B`` replicated. Two axes splitting the same dim nest in
mesh-axis order (the first axis is the major one), as in ``autopar.ir.placement``. All tensors are
float32 (4 bytes) and every split is even. ``@`` is matmul over the last dim of the left operand
and the first dim of the right operand (batched over leading dims, like ``torch.matmul``).

Program table (shape, placement of every tensor; "=" gives how it is computed)
---------------------------------------------------------------------------

1. ``matmul_chain`` -- mesh (8,) axes ("tp",)
   ======  ===========  =========  ==============================
   tensor  shape        placement  definition
   ======  ===========  =========  ==============================
   x       [16, 32]     B          input
   w1      [32, 64]     S(1)       input
   w2      [64, 32]     S(0)       input
   h       [16, 64]     S(1)       x @ w1
   y       [16, 32]     B          h @ w2            (output)
   ======  ===========  =========  ==============================

2. ``megatron_mlp`` -- mesh (8,) axes ("tp",)
   x [16, 32] B (input); w1 [32, 128] S(1) (input); w2 [128, 32] S(0) (input);
   a [16, 128] S(1) = x @ w1;  h [16, 128] S(1) = gelu(a) (exact erf gelu, torch's default);
   y [16, 32] B = h @ w2 (output).

3. ``megatron_mlp_sp`` -- mesh (8,) axes ("tp",); sequence parallel
   x [16, 32] S(0) (input); w1 [32, 128] S(1); w2 [128, 32] S(0);
   a [16, 128] S(1) = x @ w1;  h [16, 128] S(1) = gelu(a);  y [16, 32] S(0) = h @ w2 (output).

4. ``attention`` -- mesh (8,) axes ("tp",); B=2 batch, H=8 heads, S=16 positions, D=8 head dim
   q, k, v  [2, 8, 16, 8]  S(1) (inputs);  wo [64, 32] S(0) (input);
   kt     [2, 8, 8, 16]   S(1) = k.transpose(-2, -1)
   s      [2, 8, 16, 16]  S(1) = q @ kt
   scaled [2, 8, 16, 16]  S(1) = s / sqrt(8)
   p      [2, 8, 16, 16]  S(1) = softmax(scaled, dim=-1)
   o      [2, 8, 16, 8]   S(1) = p @ v
   t      [2, 16, 8, 8]   S(2) = o.transpose(1, 2)
   r      [2, 16, 64]     S(2) = t.reshape(2, 16, 64)
   y      [2, 16, 32]     B    = r @ wo (output)

5. ``reshard_2d`` -- mesh (2, 4) axes ("dp", "tp")
   x [16, 32] "S(0), S(1)" (input);  y [16, 32] "S(1), S(0)" = x * 2 (output).
   (dp splits dim 0 and tp dim 1 of x; dp splits dim 1 and tp dim 0 of y.)

6. ``reshard_2d_b`` -- mesh (2, 4) axes ("dp", "tp")
   x [16, 32] "S(0), B" (input);  y [16, 32] "B, S(0)" = x * 2 (output).

7. ``reshape_between_layouts`` -- mesh (8,) axes ("tp",)
   x [16, 64] S(0) (input);
   r    [16, 8, 8] S(0) = x.reshape(16, 8, 8)
   r_s1 [16, 8, 8] S(1) = r, redistributed (the same value under a second constraint)
   z    [16, 64]   S(1) = r_s1.reshape(16, 64) (output)

8. ``dp_mlp_grad`` -- mesh (8,) axes ("dp",); data-parallel gradient of a linear layer
   x [16, 32] S(0) (input);  w [32, 16] B (input);
   forward (under jax.grad w.r.t. w):  y [16, 16] S(0) = x @ w;  sq [16, 16] S(0) = y ** 2;
   loss [] B = sq.sum();  grad_w [32, 16] B = d loss / d w (output; the only output, so the
   forward loss is dead code). A sharding constraint's transpose pins the cotangent the same way,
   so d loss, d sq and d y are pinned B, S(0) and S(0) as well.

The machine-readable form of this table is ``PROGRAMS`` below; the self-check test compares it with
the constraints the JAX programs actually apply.

Normalised collectives
----------------------
``xla_collectives`` returns a list of ``{"kind", "axis", "bytes"}``, sorted by (kind, axis, bytes):

* kind: ``all_gather`` / ``all_reduce`` / ``reduce_scatter`` / ``all_to_all`` / ``collective_permute``.
* axis: the mesh axis the replica groups run along (``"a+b"`` when the groups span several axes;
  ``"tp:(2)2"`` for a sub-axis in Shardy's notation -- tp of size n viewed as [2, 2, n/4], the groups
  varying the middle factor; ``"none"`` for single-device groups; ``"groups=..."`` if nothing
  matches). For a collective-permute: the whole axes along which its source/target pairs differ.
* bytes: the tensor as the group sees it -- all_gather: output bytes (operand x group size);
  all_reduce: operand bytes; reduce_scatter: input bytes; all_to_all: operand bytes x group size;
  collective_permute: operand bytes (what each device sends).

Normalisations (each can be switched off, see ``xla_collectives``): a tuple (combined) collective is
split into one entry per operand (except all-to-all, whose operands are the chunks of one exchange);
an all-reduce whose every use is a dynamic-slice that keeps 1/group of it is a ``reduce_scatter``
(``normalise_rs``); an all-reduce whose operand is a dynamic-update-slice of 1/group of it into a
buffer is an ``all_gather`` (``normalise_ag``). ``xla_collectives_detail`` tells which records were
normalised. Run this file as a script to print everything (``--hlo`` also prints the HLO).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from math import prod

# --------------------------------------------------------------------------------------------
# The program table (machine-readable). Placements are by name ("tp=S(1)"; axes not named are B,
# "B" alone = replicated everywhere) so that a program can also be compiled on another mesh that
# has the named axes.

PROGRAMS: dict[str, dict] = {
    "matmul_chain": dict(
        mesh=((8,), ("tp",)),
        inputs=[("x", [16, 32], "B"), ("w1", [32, 64], "tp=S(1)"), ("w2", [64, 32], "tp=S(0)")],
        pins=[("h", [16, 64], "tp=S(1)"), ("y", [16, 32], "B")],
        outputs=[("y", [16, 32], "B")],
    ),
    "megatron_mlp": dict(
        mesh=((8,), ("tp",)),
        inputs=[("x", [16, 32], "B"), ("w1", [32, 128], "tp=S(1)"), ("w2", [128, 32], "tp=S(0)")],
        pins=[("a", [16, 128], "tp=S(1)"), ("h", [16, 128], "tp=S(1)"), ("y", [16, 32], "B")],
        outputs=[("y", [16, 32], "B")],
    ),
    "megatron_mlp_sp": dict(
        mesh=((8,), ("tp",)),
        inputs=[("x", [16, 32], "tp=S(0)"), ("w1", [32, 128], "tp=S(1)"), ("w2", [128, 32], "tp=S(0)")],
        pins=[("a", [16, 128], "tp=S(1)"), ("h", [16, 128], "tp=S(1)"), ("y", [16, 32], "tp=S(0)")],
        outputs=[("y", [16, 32], "tp=S(0)")],
    ),
    "attention": dict(
        mesh=((8,), ("tp",)),
        inputs=[
            ("q", [2, 8, 16, 8], "tp=S(1)"),
            ("k", [2, 8, 16, 8], "tp=S(1)"),
            ("v", [2, 8, 16, 8], "tp=S(1)"),
            ("wo", [64, 32], "tp=S(0)"),
        ],
        pins=[
            ("kt", [2, 8, 8, 16], "tp=S(1)"),
            ("s", [2, 8, 16, 16], "tp=S(1)"),
            ("scaled", [2, 8, 16, 16], "tp=S(1)"),
            ("p", [2, 8, 16, 16], "tp=S(1)"),
            ("o", [2, 8, 16, 8], "tp=S(1)"),
            ("t", [2, 16, 8, 8], "tp=S(2)"),
            ("r", [2, 16, 64], "tp=S(2)"),
            ("y", [2, 16, 32], "B"),
        ],
        outputs=[("y", [2, 16, 32], "B")],
    ),
    "reshard_2d": dict(
        mesh=((2, 4), ("dp", "tp")),
        inputs=[("x", [16, 32], "dp=S(0), tp=S(1)")],
        pins=[("y", [16, 32], "dp=S(1), tp=S(0)")],
        outputs=[("y", [16, 32], "dp=S(1), tp=S(0)")],
    ),
    "reshard_2d_b": dict(
        mesh=((2, 4), ("dp", "tp")),
        inputs=[("x", [16, 32], "dp=S(0)")],
        pins=[("y", [16, 32], "tp=S(0)")],
        outputs=[("y", [16, 32], "tp=S(0)")],
    ),
    "reshape_between_layouts": dict(
        mesh=((8,), ("tp",)),
        inputs=[("x", [16, 64], "tp=S(0)")],
        pins=[("r", [16, 8, 8], "tp=S(0)"), ("r_s1", [16, 8, 8], "tp=S(1)"), ("z", [16, 64], "tp=S(1)")],
        outputs=[("z", [16, 64], "tp=S(1)")],
    ),
    "dp_mlp_grad": dict(
        mesh=((8,), ("dp",)),
        inputs=[("x", [16, 32], "dp=S(0)"), ("w", [32, 16], "B")],
        # Pins in the order JAX applies them (forward under grad, then the gradient itself).
        pins=[
            ("y", [16, 16], "dp=S(0)"),
            ("sq", [16, 16], "dp=S(0)"),
            ("loss", [], "B"),
            ("grad_w", [32, 16], "B"),
        ],
        outputs=[("grad_w", [32, 16], "B")],
    ),
}


def positional(placement: str, axis_names) -> str:
    """By-name placement ("dp=S(0)") -> positional text on a mesh ("S(0), B")."""
    out = ["B"] * len(axis_names)
    if placement.strip() != "B":
        for part in re.findall(r"(\w+)\s*=\s*(S\(\d+\)|B)", placement):
            out[list(axis_names).index(part[0])] = part[1]
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# The worker: runs in the subprocess, imports jax, compiles the programs, prints the HLO texts.

_MARK = "XLA_ORACLE_JSON:"


def _worker(jobs: list[dict]) -> dict:  # pragma: no cover - runs in the subprocess
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    results = {}
    for job in jobs:
        name, mesh_shape, axis_names = job["program"], tuple(job["mesh_shape"]), tuple(job["axis_names"])
        n = prod(mesh_shape)
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), axis_names)

        def spec(placement: str, ndim: int) -> PartitionSpec:
            per_dim: list[list[str]] = [[] for _ in range(ndim)]
            if placement.strip() != "B":
                for ax, kind in re.findall(r"(\w+)\s*=\s*(S\(\d+\)|B)", placement):
                    if ax not in axis_names:
                        raise ValueError(f"{name}: placement {placement!r} names axis {ax!r}, mesh has {axis_names}")
                    if kind != "B":
                        per_dim[int(kind[2:-1])].append(ax)
            for dims in per_dim:  # nest in mesh-axis order
                dims.sort(key=axis_names.index)
            return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in per_dim])

        def sharding(placement: str, ndim: int) -> NamedSharding:
            return NamedSharding(mesh, spec(placement, ndim))

        pins: list[list] = []

        def pin(label, value, placement):
            pins.append([label, list(value.shape), placement])
            return jax.lax.with_sharding_constraint(value, sharding(placement, value.ndim))

        def matmul_chain(x, w1, w2):
            h = pin("h", x @ w1, "tp=S(1)")
            return pin("y", h @ w2, "B")

        def megatron_mlp(x, w1, w2, y_placement="B"):
            a = pin("a", x @ w1, "tp=S(1)")
            h = pin("h", jax.nn.gelu(a, approximate=False), "tp=S(1)")
            return pin("y", h @ w2, y_placement)

        def megatron_mlp_sp(x, w1, w2):
            return megatron_mlp(x, w1, w2, y_placement="tp=S(0)")

        def attention(q, k, v, wo):
            d = q.shape[-1]
            kt = pin("kt", jnp.swapaxes(k, -2, -1), "tp=S(1)")
            s = pin("s", q @ kt, "tp=S(1)")
            scaled = pin("scaled", s / np.float32(np.sqrt(d)), "tp=S(1)")
            p = pin("p", jax.nn.softmax(scaled, axis=-1), "tp=S(1)")
            o = pin("o", p @ v, "tp=S(1)")
            t = pin("t", jnp.swapaxes(o, 1, 2), "tp=S(2)")
            r = pin("r", t.reshape(t.shape[0], t.shape[1], -1), "tp=S(2)")
            return pin("y", r @ wo, "B")

        def reshard_2d(x):
            return pin("y", x * 2, "dp=S(1), tp=S(0)")

        def reshard_2d_b(x):
            return pin("y", x * 2, "tp=S(0)")

        def reshape_between_layouts(x):
            r = pin("r", x.reshape(16, 8, 8), "tp=S(0)")
            r_s1 = pin("r_s1", r, "tp=S(1)")
            return pin("z", r_s1.reshape(16, 64), "tp=S(1)")

        def dp_mlp_grad(x, w):
            def loss_fn(w):
                y = pin("y", x @ w, "dp=S(0)")
                sq = pin("sq", y**2, "dp=S(0)")
                return pin("loss", sq.sum(), "B")

            return pin("grad_w", jax.grad(loss_fn)(w), "B")

        fns = {
            "matmul_chain": matmul_chain,
            "megatron_mlp": megatron_mlp,
            "megatron_mlp_sp": megatron_mlp_sp,
            "attention": attention,
            "reshard_2d": reshard_2d,
            "reshard_2d_b": reshard_2d_b,
            "reshape_between_layouts": reshape_between_layouts,
            "dp_mlp_grad": dp_mlp_grad,
        }
        prog = PROGRAMS[name]
        t0 = time.perf_counter()
        jitted = jax.jit(
            fns[name],
            in_shardings=tuple(sharding(p, len(s)) for _, s, p in prog["inputs"]),
            out_shardings=sharding(prog["outputs"][0][2], len(prog["outputs"][0][1])),
        )
        args = [jax.ShapeDtypeStruct(tuple(s), jnp.float32) for _, s, _ in prog["inputs"]]
        hlo = jitted.lower(*args).compile().as_text()
        results[job["key"]] = dict(hlo=hlo, pins=pins, compile_s=time.perf_counter() - t0)
    return dict(results=results, jax_version=jax.__version__)


# --------------------------------------------------------------------------------------------
# HLO text parsing (pure Python; runs in the caller's process).

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip


def _balanced(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_ch}{close_ch} in {text[start:start + 200]!r}")


def _array_shapes(shape: str) -> list[tuple[str, list[int]]]:
    return [(dt, [int(d) for d in dims.split(",") if d]) for dt, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape)]


def _nbytes(shape: str) -> int:
    return sum(_DTYPE_BYTES[dt] * prod(dims) for dt, dims in _array_shapes(shape))


def _nelems(shape: str) -> int:
    return sum(prod(dims) for _, dims in _array_shapes(shape))


class _Instr:
    __slots__ = ("name", "shape", "opcode", "operands", "attrs", "line", "comp")

    def __init__(self, name, shape, opcode, operands, attrs, line, comp):
        self.name, self.shape, self.opcode = name, shape, opcode
        self.operands, self.attrs, self.line, self.comp = operands, attrs, line, comp


def parse_hlo(text: str) -> dict[str, list[_Instr]]:
    """Computations of an HLO module text: name -> its instructions in order."""
    comps: dict[str, list[_Instr]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
        if cur is None or not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _balanced(rest, 0, "(", ")")
            shape, rest = rest[:end], rest[end:].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        om = re.match(r"([\w\-]+)\(", rest)
        if not om:
            continue
        opcode = om.group(1)
        end = _balanced(rest, om.end() - 1, "(", ")")
        operands = re.findall(r"%([\w.\-]+)", rest[om.end() : end - 1])
        comps[cur].append(_Instr(name, shape, opcode, operands, rest[end:], line.strip(), cur))
    return comps


def _iota(reshape_dims: list[int], perm: list[int] | None):
    import numpy as np

    a = np.arange(prod(reshape_dims)).reshape(reshape_dims)
    return a.transpose(perm) if perm else a


def _groups_from_attrs(attrs: str, n_devices: int) -> list[list[int]]:
    """Device groups of a collective's ``replica_groups`` attribute (all three textual forms)."""
    import numpy as np

    m = re.search(r"replica_groups=", attrs)
    if not m:
        return [list(range(n_devices))]
    s = attrs[m.end() :]
    if s.startswith("{"):  # explicit: {{0,1},{2,3}} or {}
        body = s[: _balanced(s, 0, "{", "}")]
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        return groups or [list(range(n_devices))]
    im = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
    if im:  # iota: [G,S]<=[dims]T(perm)
        g, size = int(im.group(1)), int(im.group(2))
        perm = [int(x) for x in im.group(4).split(",")] if im.group(4) else None
        return _iota([int(x) for x in im.group(3).split(",")], perm).reshape(g, size).tolist()
    mm = re.match(r"mesh\[([^\]]*)\]", s)
    if mm:  # mesh['a'=2,'b'=4](, device_ids=(...))? {'a','b':(1)2}
        axes = [(a, int(sz)) for a, sz in re.findall(r"'([^']+)'=(\d+)", mm.group(1))]
        sizes = [sz for _, sz in axes]
        rest = s[mm.end() :]
        ids = np.arange(prod(sizes))
        dm = re.match(r",\s*device_ids=\(", rest)
        if dm:
            end = _balanced(rest, dm.end() - 1, "(", ")")
            body = rest[dm.end() : end - 1]
            it = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", body)
            if it:
                perm = [int(x) for x in it.group(2).split(",")] if it.group(2) else None
                ids = _iota([int(x) for x in it.group(1).split(",")], perm).reshape(-1)
            else:
                nums = [int(x) for x in re.findall(r"\d+", body)]
                if len(nums) != len(ids):
                    raise ValueError(f"cannot read device_ids=({body}) of {s[:200]!r}")
                ids = np.array(nums)
            rest = rest[end:]
        gm = re.match(r"\s*\{([^}]*)\}", rest)
        grouped = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", gm.group(1)) if gm else []
        names = [a for a, _ in axes]
        dev = ids.reshape(sizes)
        buckets: dict[tuple, list[int]] = {}
        for pos in itertools.product(*[range(sz) for sz in sizes]):
            key = list(pos)
            for axis, pre, sub in grouped:
                a = names.index(axis)
                if not pre:
                    key[a] = None
                else:  # sub-axis: axis of size n viewed as [pre, sub, n/(pre*sub)], group varies the middle
                    minor = sizes[a] // (int(pre) * int(sub))
                    digit = (pos[a] // minor) % int(sub)
                    key[a] = (key[a] if isinstance(key[a], int) else pos[a]) - digit * minor
            buckets.setdefault(tuple(key), []).append(int(dev[pos]))
        return list(buckets.values())
    raise ValueError(f"unknown replica_groups form: {s[:200]!r}")


def _axis_choices(size: int):
    """Ways one mesh axis can take part in a group: out, whole, or a sub-axis (pre, sub) of it."""
    yield None
    yield "whole"
    for pre in range(1, size + 1):
        for sub in range(2, size):
            if size % (pre * sub) == 0:
                yield (pre, sub)


def _axis_label(groups: list[list[int]], mesh_shape, axis_names) -> str:
    """The mesh axes a replica-group list runs along: "tp", "dp+tp", or a Shardy-style sub-axis
    "tp:(2)2" (tp of size n viewed as [pre, sub, n/(pre*sub)], the group varying the middle)."""
    import numpy as np

    if all(len(g) == 1 for g in groups):
        return "none"
    target = frozenset(frozenset(g) for g in groups)
    coords = np.array(np.unravel_index(np.arange(prod(mesh_shape)), mesh_shape)).T
    best = None
    for choice in itertools.product(*[list(_axis_choices(n)) for n in mesh_shape]):
        if all(c is None for c in choice):
            continue
        buckets: dict[tuple, set] = {}
        for dev, pos in enumerate(coords):
            key = []
            for a, c in enumerate(choice):
                if c is None:
                    key.append(int(pos[a]))
                elif c != "whole":
                    minor = mesh_shape[a] // (c[0] * c[1])
                    key.append(int(pos[a]) - ((int(pos[a]) // minor) % c[1]) * minor)
            buckets.setdefault(tuple(key), set()).add(dev)
        if frozenset(frozenset(b) for b in buckets.values()) == target:
            label = "+".join(
                axis_names[a] if c == "whole" else f"{axis_names[a]}:({c[0]}){c[1]}"
                for a, c in enumerate(choice) if c is not None
            )
            if best is None or label.count(":") < best.count(":"):
                best = label
    return best or "groups=" + json.dumps(sorted(sorted(g) for g in groups))


def _permute_label(attrs: str, mesh_shape, axis_names) -> str:
    import numpy as np

    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=")[1])]
    coords = np.array(np.unravel_index(np.arange(prod(mesh_shape)), mesh_shape)).T
    differ = sorted({a for s, t in pairs for a in range(len(mesh_shape)) if coords[s][a] != coords[t][a]})
    return "+".join(axis_names[a] for a in differ) or "none"


_KINDS = {
    "all-gather": "all_gather", "all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all", "collective-permute": "collective_permute",
}  # fmt: skip
_PASS_THROUGH = {"bitcast", "reshape", "copy", "convert"}


def _called(instr: _Instr) -> str | None:
    m = re.search(r"calls=%?([\w.\-]+)", instr.attrs)
    return m.group(1) if m else None


def _users(comp: list[_Instr], name: str) -> list[tuple[_Instr, int]]:
    return [(u, i) for u in comp for i, o in enumerate(u.operands) if o == name]


def _slice_only_uses(comps, comp_name: str, name: str, depth: int = 0) -> list[_Instr] | None:
    """The dynamic-slices that are the only uses of ``name`` (through fusions and bitcasts), or None."""
    comp = comps[comp_name]
    uses = _users(comp, name)
    if not uses or depth > 4:
        return None
    slices = []
    for u, idx in uses:
        if u.opcode == "dynamic-slice" and idx == 0:
            slices.append(u)
        elif u.opcode in _PASS_THROUGH:
            sub = _slice_only_uses(comps, comp_name, u.name, depth + 1)
            if sub is None:
                return None
            slices += sub
        elif u.opcode == "fusion" and _called(u) in comps:
            fused = comps[_called(u)]
            params = [p for p in fused if p.opcode == "parameter" and re.search(rf"\bparameter\({idx}\)", p.line)]
            if len(params) != 1:
                return None
            sub = _slice_only_uses(comps, _called(u), params[0].name, depth + 1)
            if sub is None:
                return None
            slices += sub
        else:
            return None
    return slices


def _update_slice_source(comps, comp_name: str, name: str, depth: int = 0) -> _Instr | None:
    """The dynamic-update-slice that produces ``name`` (through fusions and bitcasts), or None."""
    comp = {i.name: i for i in comps[comp_name]}
    instr = comp.get(name)
    if instr is None or depth > 4:
        return None
    if instr.opcode == "dynamic-update-slice":
        return instr
    if instr.opcode in _PASS_THROUGH:
        return _update_slice_source(comps, comp_name, instr.operands[0], depth + 1)
    if instr.opcode == "fusion" and _called(instr) in comps:
        fused = comps[_called(instr)]
        root = next((i for i in fused if i.line.startswith("ROOT")), None)
        if root is not None:
            found = _update_slice_source(comps, _called(instr), root.name, depth + 1)
            if found is not None:
                return found
    return None


def collectives_from_hlo(hlo: str, mesh_shape, axis_names, normalise_rs=True, normalise_ag=True) -> list[dict]:
    """Every collective of an HLO module text, normalised, with details (see the module docstring)."""
    mesh_shape, axis_names = tuple(mesh_shape), tuple(axis_names)
    comps = parse_hlo(hlo)
    n = prod(mesh_shape)
    out = []
    for comp_name, comp in comps.items():
        shapes = {i.name: i.shape for i in comp}
        for instr in comp:
            base = instr.opcode[: -len("-start")] if instr.opcode.endswith("-start") else instr.opcode
            if base not in _KINDS:
                continue
            kind = _KINDS[base]
            if kind == "collective_permute":
                for o in instr.operands:
                    out.append(dict(kind=kind, axis=_permute_label(instr.attrs, mesh_shape, axis_names),
                                    bytes=_nbytes(shapes[o]), shape=shapes[o], opcode=instr.opcode,
                                    normalised_from=None, line=instr.line))
                continue
            groups = _groups_from_attrs(instr.attrs, n)
            gsize = len(groups[0])
            axis = _axis_label(groups, mesh_shape, axis_names)
            if kind == "all_to_all":
                total = sum(_nbytes(shapes[o]) for o in instr.operands)
                out.append(dict(kind=kind, axis=axis, bytes=total * gsize, shape=instr.shape, opcode=instr.opcode,
                                normalised_from=None, line=instr.line))
                continue
            tuple_result = instr.shape.startswith("(") and base == "all-reduce"
            for idx, o in enumerate(instr.operands):
                ob = _nbytes(shapes[o])
                rec = dict(kind=kind, axis=axis, bytes=ob * gsize if kind == "all_gather" else ob, shape=shapes[o],
                           opcode=instr.opcode, normalised_from=None, line=instr.line)
                if kind == "all_reduce":
                    if tuple_result:
                        results = [u.name for u, _ in _users(comp, instr.name) if u.opcode == "get-tuple-element"
                                   and re.search(rf"index={idx}\b", u.attrs)]
                    else:
                        results = [instr.name]
                    slices = None
                    if normalise_rs and len(results) == 1:
                        slices = _slice_only_uses(comps, comp_name, results[0])
                    dus = _update_slice_source(comps, comp_name, o) if normalise_ag else None
                    if slices and all(_nelems(s.shape) * gsize == _nelems(shapes[o]) for s in slices):
                        rec.update(kind="reduce_scatter", normalised_from="all-reduce + dynamic-slice")
                    elif dus is not None:
                        dcomp = {i.name: i for i in comps[dus.comp]}
                        upd = dcomp.get(dus.operands[1])
                        if upd is not None and _nelems(upd.shape) * gsize == _nelems(shapes[o]):
                            rec.update(kind="all_gather", normalised_from="dynamic-update-slice + all-reduce")
                out.append(rec)
    out.sort(key=lambda r: (r["kind"], r["axis"], r["bytes"]))
    return out


# --------------------------------------------------------------------------------------------
# The public API.

_CACHE: dict[str, dict] = {}
_INFO: dict[str, object] = {}


def _key(program: str, mesh_shape, axis_names) -> str:
    return f"{program}|{','.join(map(str, mesh_shape))}|{','.join(axis_names)}"


def _run_jobs(jobs: list[dict]) -> None:
    env = dict(os.environ)
    n = max([8] + [prod(j["mesh_shape"]) for j in jobs])
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"],
        input=json.dumps(jobs), capture_output=True, text=True, env=env, timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"XLA oracle subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    payload = json.loads(lines[-1][len(_MARK) :])
    _CACHE.update(payload["results"])
    _INFO["jax_version"] = payload["jax_version"]
    _INFO["last_run_s"] = time.perf_counter() - t0


def _result(program: str, mesh_shape=None, axis_names=None) -> dict:
    if program not in PROGRAMS:
        raise KeyError(f"unknown program {program!r}; known: {sorted(PROGRAMS)}")
    d_shape, d_names = PROGRAMS[program]["mesh"]
    mesh_shape = tuple(mesh_shape) if mesh_shape is not None else d_shape
    axis_names = tuple(axis_names) if axis_names is not None else d_names
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"mesh_shape {mesh_shape} and axis_names {axis_names} differ in length")
    key = _key(program, mesh_shape, axis_names)
    if key not in _CACHE:
        jobs = [dict(key=key, program=program, mesh_shape=list(mesh_shape), axis_names=list(axis_names))]
        if (mesh_shape, axis_names) == (d_shape, d_names):  # first use: compile every default program at once
            jobs = [dict(key=_key(p, *spec["mesh"]), program=p, mesh_shape=list(spec["mesh"][0]),
                         axis_names=list(spec["mesh"][1])) for p, spec in PROGRAMS.items()
                    if _key(p, *spec["mesh"]) not in _CACHE]  # fmt: skip
        _run_jobs(jobs)
    return _CACHE[key]


def xla_collectives_detail(program: str, mesh_shape=None, axis_names=None, normalise_rs=True, normalise_ag=True):
    """Like ``xla_collectives`` but each record also has shape, opcode, normalised_from and the HLO line."""
    res = _result(program, mesh_shape, axis_names)
    d_shape, d_names = PROGRAMS[program]["mesh"]
    return collectives_from_hlo(res["hlo"], mesh_shape or d_shape, axis_names or d_names, normalise_rs, normalise_ag)


def xla_collectives(program: str, mesh_shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None,
                    normalise_rs: bool = True, normalise_ag: bool = True) -> list[dict]:  # fmt: skip
    """The normalised collectives XLA's SPMD partitioner emits for ``program`` on the given mesh.

    The mesh defaults to the program's own (see ``PROGRAMS``); another mesh works if it has every
    axis the program's placements name and its sizes divide the split dims. Each record is
    ``{"kind", "axis", "bytes"}``; the list is sorted by (kind, axis, bytes).
    """
    recs = xla_collectives_detail(program, mesh_shape, axis_names, normalise_rs, normalise_ag)
    return [dict(kind=r["kind"], axis=r["axis"], bytes=r["bytes"]) for r in recs]


def xla_hlo(program: str, mesh_shape=None, axis_names=None) -> str:
    """The optimized HLO text XLA compiled for ``program``."""
    return _result(program, mesh_shape, axis_names)["hlo"]


def xla_pins(program: str, mesh_shape=None, axis_names=None) -> list[tuple[str, list[int], str]]:
    """The sharding constraints the JAX program applied: (label, shape, by-name placement)."""
    return [tuple(p) for p in _result(program, mesh_shape, axis_names)["pins"]]


def all_xla_collectives(normalise_rs: bool = True, normalise_ag: bool = True) -> dict[str, list[dict]]:
    """Every program on its own mesh: name -> normalised collectives (one subprocess, cached)."""
    return {p: xla_collectives(p, normalise_rs=normalise_rs, normalise_ag=normalise_ag) for p in PROGRAMS}


def oracle_info() -> dict:
    """jax version and the wall time of the last subprocess run (after a call that ran one)."""
    return dict(_INFO)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        out = _worker(json.loads(sys.stdin.read()))
        print(_MARK + json.dumps(out))
    else:
        t0 = time.perf_counter()
        everything = all_xla_collectives()
        for prog, colls in everything.items():
            spec = PROGRAMS[prog]
            print(f"== {prog}  mesh {spec['mesh'][0]} {spec['mesh'][1]}")
            for r in xla_collectives_detail(prog):
                print(f"   {r['kind']:<19} axis={r['axis']:<6} bytes={r['bytes']:<6} "
                      f"{'(' + r['normalised_from'] + ') ' if r['normalised_from'] else ''}{r['line'][:160]}")
            if "--hlo" in sys.argv:
                print(xla_hlo(prog))
        print(f"jax {oracle_info().get('jax_version')}; subprocess {oracle_info().get('last_run_s', 0):.2f}s; "
              f"total {time.perf_counter() - t0:.2f}s")
