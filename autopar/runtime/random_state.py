"""The state of a compiled program's random draws (dropout): its seed and step on every rank.

A program with random ops draws from a counter-based generator keyed on ``(seed, step, op,
element)`` (``ir.rules.random_ops``): ``share_seed`` gives every rank rank 0's seed, drawn from
torch's default generator; ``ParallelModule`` advances the step once per forward, runs each
backward at its forward's step (``at_step``) and keeps ``[seed, step]`` in its ``state_dict`` under
``RANDOM_KEY`` (``add_random_entry`` / ``take_random_entry``); so does the pipelined module (one step
per ``pmodel(...)`` call), so a checkpoint carries the next step's draws across layouts.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from autopar import _torch_compat as tc
from autopar.ir.rules.random_ops import draw_seed
from autopar.program.program import Program, RandomOp, RandomState

#: The ``state_dict`` entry of a program with random ops: ``int64 [seed, step]`` (the next forward's
#: step), a replicated DTensor. The single-device model has no such entry: drop it to load there.
RANDOM_KEY = "_autopar_random"


def shared_seed(group: Optional[dist.ProcessGroup] = None) -> int:
    """Every rank of ``group`` (default: the world) draws a seed from torch's default generator
    (their generators advance alike); all get the group's first rank's. A collective."""
    box = [draw_seed()]
    if group is None:
        dist.broadcast_object_list(box, src=0)
    else:
        dist.broadcast_object_list(box, group=group, group_src=0)
    return int(box[0])


def share_seed(program: Program) -> None:
    """Every rank draws a seed (their generators advance alike); all use rank 0's. A collective:
    call it on every rank, for a program with random ops."""
    if program.random is None:
        return
    program.random.seed = shared_seed()


def random_entry(program: Program, device_mesh, device: Optional[torch.device]):
    """``[seed, step]`` as a DTensor replicated on ``device_mesh`` (``full_tensor()`` and DCP work on
    it as on the parameters); None without random ops."""
    from torch.distributed.tensor import DTensor, Replicate

    rs = program.random
    if rs is None:
        return None
    value = torch.tensor([rs.seed, rs.step], dtype=torch.int64, device=device)
    return DTensor.from_local(value, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)


def random_tensor(rs: RandomState) -> torch.Tensor:
    """``[seed, step]`` as a plain int64 tensor (the pipeline axis alone keeps whole tensors)."""
    return torch.tensor([rs.seed, rs.step], dtype=torch.int64)


def load_random_entry(program: Program, value: torch.Tensor) -> None:
    """Set the program's seed and step from a ``RANDOM_KEY`` entry (a DTensor or a plain tensor)."""
    if program.random is not None:
        _load(program.random, value)


def _load(rs: RandomState, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    whole = value.full_tensor() if isinstance(value, DTensor) else value
    rs.seed, rs.step = (int(v) for v in whole.tolist())


def add_random_entry(out: dict, program: Program, device_mesh, prefix: str = "") -> dict:
    """``out`` (a module's ``state_dict``) with ``prefix + RANDOM_KEY`` added where the program has
    random ops, on ``device_mesh`` (every rank of the run: DCP keeps one copy) and the device of
    ``out``'s tensors."""
    if program.random is not None:
        where = next((v.device for v in out.values() if isinstance(v, torch.Tensor)), None)
        out[prefix + RANDOM_KEY] = random_entry(program, device_mesh, where)
    return out


def take_random_entry(program: Program, state_dict):
    """``state_dict`` without ``RANDOM_KEY``, the program's seed and step set from it where it is there."""
    return take_random_state(program.random, state_dict)


def take_random_state(rs: Optional[RandomState], state_dict):
    """``state_dict`` without ``RANDOM_KEY``, ``rs``'s seed and step set from it where it is there."""
    if RANDOM_KEY not in state_dict or rs is None:
        return state_dict
    _load(rs, state_dict[RANDOM_KEY])
    return tc.with_metadata({k: v for k, v in state_dict.items() if k != RANDOM_KEY}, state_dict)


@contextlib.contextmanager
def at_step(program: Program, step: Optional[int]) -> Iterator[None]:
    """Run at ``step`` (a backward at its forward's: it redraws that forward's attention masks),
    then restore the current step."""
    rs = program.random
    if rs is None or step is None:
        yield
        return
    later, rs.step = rs.step, step
    try:
        yield
    finally:
        rs.step = later


#: Ops that only reshape their (contiguous) input: the batch is followed through the element order.
_RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})


def batch_dims(graph, rows: int) -> dict[str, int]:
    """Per random op of ``graph`` (a capture at the micro-batch's shape, ``rows`` samples): the dim
    of its output along which the micro-batch is one contiguous block of the whole batch's tensor
    (the batch leads that dim, alone or as the major factor of merged dims: ``B*H`` with ``B`` major
    holds micro-batch ``k`` at rows ``k*rows*H``, which ``program.micro_ctx`` cuts). Found by following
    the inputs' dim 0 (where it has ``rows``) through every op: the batch is a digit (radix ``rows``,
    stride ``inner``) of a dim, major (``inner * rows`` is the dim's size) or not (``(S*B)`` after a
    flatten: followed, so a later split gives it back); a reshape moves it by the element order, any
    other op by its ``DimMap``'s factors. Raises where a random op's output has no dim the batch leads
    (its micro-batches' draws could not be placed in the whole batch's). An attention backward draws
    with its forward's entry."""
    from autopar.errors import ArgumentError
    from autopar.ir.graph import Ref
    from autopar.ir.rules.random_attention import is_random_call, key_node

    marked: dict = {}  # Ref -> {dim: the batch digit's stride along that dim}
    for name in graph.inputs.values():
        shape = graph.spec(Ref(name)).shape
        if shape and shape[0] == rows:
            marked[Ref(name)] = {0: 1}
    out: dict[str, int] = {}
    for node in graph.nodes:
        if node.is_placeholder:
            continue
        for ref, dims in _carry(graph, node, marked, rows).items():
            marked.setdefault(ref, {}).update(dims)
        if is_random_call(node.op, node.args, node.kwargs) and key_node(graph, node) == node.name:
            shape = node.out.shape
            held = marked.get(Ref(node.name), {})
            dims_ = [d for d in range(len(shape)) if held.get(d) == shape[d] // rows]
            if not dims_:
                raise ArgumentError(f"autopar pipeline: the random op at {node.where()} draws on a tensor "
                                    f"{tuple(shape)} in which no dim is led by the batch, so its "
                                    "micro-batches' draws cannot be numbered as the whole batch's; run it "
                                    "without dropout (p=0 or model.eval()) or plan with pipeline={'microbatches': 1}")
            out[node.name] = dims_[0]
    return out


def _carry(graph, node, marked: dict, rows: int) -> dict:
    """The batch marks of ``node``'s outputs (``{Ref: {dim: stride}}``) from its inputs' ``marked``."""
    from autopar.ir.graph import Ref
    from autopar.ir.rules.base import dimmap, op_call

    if not any(r in marked for r in node.inputs or ()):
        return {}
    if node.op in _RESHAPES and len(node.outputs) == 1 and node.outputs[0] is not None:
        got: dict = {}
        r = node.inputs[0]
        for d, s in marked.get(r, {}).items():
            step = s * math.prod(graph.spec(r).shape[d + 1:])  # the batch digit's stride in the element order
            for e, size in enumerate(node.out.shape):
                t = math.prod(node.out.shape[e + 1:])
                if step % t == 0 and (t * size) % (step * rows) == 0:
                    got.setdefault(Ref(node.name), {})[e] = step // t
        return got
    try:
        dm = dimmap(op_call(graph, node))
    except Exception:  # noqa: BLE001 - an op without a DimMap carries no mark on
        return {}
    runs = set()
    for r, dims in zip(node.inputs, dm.inputs):
        for d in range(len(dims or ())):
            if d in marked.get(r, {}):
                run = _digit(dims[d], dm.sizes, marked[r][d], rows)
                if run is not None:
                    runs.add(run)
    got = {}
    for j, dims in enumerate(dm.outputs):
        if dims is None or node.outputs[j] is None:
            continue
        for e, factors in enumerate(dims):
            live = [f for f in factors if dm.sizes[f] != 1]
            for run, rel in runs:
                k = next((i for i in range(len(live)) if tuple(live[i:i + len(run)]) == run), None)
                if k is not None:
                    got.setdefault(Ref(node.name, j), {})[e] = rel * math.prod(dm.sizes[f] for f in live[k + len(run):])
    return got


def _digit(factors, sizes, stride: int, rows: int):
    """``(run, rel)``: the consecutive factors of a dim (``factors``, major first) that hold its batch
    digit (radix ``rows`` at ``stride``) whole, and the digit's stride within the run; None where
    the digit straddles a factor's edge (it cannot be followed)."""
    live = [f for f in factors if sizes[f] != 1]
    strides = [math.prod(sizes[f] for f in live[i + 1:]) for i in range(len(live))]
    lo = next((i for i in range(len(live)) if strides[i] <= stride < strides[i] * sizes[live[i]]), None)
    if lo is None or stride % strides[lo]:
        return None
    hi = next((i for i in range(lo, -1, -1) if strides[i] * sizes[live[i]] >= stride * rows), None)
    if hi is None or (strides[hi] * sizes[live[hi]]) % (stride * rows):
        return None
    return tuple(live[hi:lo + 1]), stride // strides[lo]


def pipelined_draws(graph, micros: int, rows: int, group: Optional[dist.ProcessGroup] = None):
    """For a runtime that interprets ``graph``'s ops eagerly (the pipeline axis alone,
    ``runtime.pipeline``): ``(state, {node: RandomOp})`` drawing each random op (dropout, attention
    with dropout) as the single-device program does, on one device at micro-batch ``state.micro``'s
    place in the whole batch; ``(None, {})`` without random ops. The seed is ``group``'s first rank's,
    from torch's default generator (``shared_seed``: a collective when there are random ops), step 0."""
    from autopar.ir.rules.base import LocalCtx, op_call
    from autopar.ir.rules.random_attention import is_random_call, key_node

    drawn = [n for n in graph.ops() if is_random_call(n.op, n.args, n.kwargs)]
    if not drawn:
        return None, {}
    rs = RandomState(seed=shared_seed(group), micros=micros, batch_dims=batch_dims(graph, rows) if micros > 1 else {})
    ops = {n.name: RandomOp(LocalCtx(op_call(graph, n), (), (), ()), key_node(graph, n), rs) for n in drawn}
    return rs, ops


def pipelined_random(program: Program, graph, micros: int, rows: int) -> None:
    """Key ``program``'s random ops (if any) for a pipelined run of ``micros`` micro-batches of
    ``rows`` samples (``RandomState.micro`` is then set before each micro-batch's part runs)."""
    rs = program.random
    if rs is None:
        return
    rs.micros, rs.micro = micros, 0
    rs.batch_dims = batch_dims(graph, rows)


__all__ = ["RANDOM_KEY", "at_step", "batch_dims", "pipelined_draws", "pipelined_random", "load_random_entry",
           "random_entry", "random_tensor", "share_seed", "shared_seed", "take_random_state"]
