"""Building a pipelined plan's module on this rank (``autopar.compile`` calls ``build_pipelined``).

With the ``pp`` axis alone it is ``runtime.pipeline.PipelinedModule`` (each stage interprets its aten
ops eagerly, unsharded). With other axes it is ``runtime.pipeline_mesh.MeshPipelinedModule``: the
model captured at the micro-batch's shape, the plan lowered for this rank's coordinates on the stage
mesh with each fx node tagged by its IR op (``lower``, handed in by ``compile``, since the runtime
sits beside the passes), run once without communication for the local shapes, and cut into stages
by the planner's chain rule (``ir.stages``) and the plan's stage lists.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from autopar._torch_compat import install_strided_checkpointing
from autopar.errors import ArgumentError
from autopar.ir.capture import capture
from autopar.ir.placement import local_block
from autopar.ir.stages import forward_readers, stage_rule
from autopar.runtime.collectives import single_worker_gloo_groups
from autopar.runtime.pipeline import PipelinedModule, micro_slices
from autopar.runtime.pipeline_cut import cut, dry_run
from autopar.runtime.pipeline_mesh import MeshPipelinedModule
from autopar.runtime.pipeline_state import drop_parameters, held_params, refuse_buffer_updates
from autopar.runtime.random_state import pipelined_random, share_seed
from autopar.runtime.state import distribute_state


def build_pipelined(model: torch.nn.Module, plan, args: tuple, kwargs: dict, lower: Callable, materializer=None,
                    fingerprint_check: Callable = lambda g: None):
    """This rank's module for pipelined ``plan`` (see the module docstring). ``lower(graph, coords)``
    returns the tagged lowered program of the stage mesh's device at ``coords``."""
    from torch.distributed.device_mesh import init_device_mesh

    pl = plan.pipeline
    names, shape = list(pl["mesh_names"]), [int(s) for s in pl["mesh_shape"]]
    if dist.get_world_size() != int(torch.tensor(shape).prod()):
        raise ArgumentError(f"autopar pipeline: the plan's mesh {dict(zip(names, shape))} needs "
                            f"{int(torch.tensor(shape).prod())} ranks, the process group has {dist.get_world_size()}")
    others = [n for n, s in zip(names, shape) if n != pl["axis"]]
    if all(s == 1 for n, s in zip(names, shape) if n != pl["axis"]):
        return PipelinedModule(model, plan, args, kwargs)
    if dist.get_backend() != "gloo":
        raise ArgumentError("autopar pipeline: pipelined plans with other mesh axes run on gloo (CPU) only so far")
    batch = next(int(v.shape[0]) for v in list(args) + list(kwargs.values())
                 if isinstance(v, torch.Tensor) and v.dim() >= 1)
    m = int(pl["microbatches"])
    if batch % m:
        raise ArgumentError(f"autopar pipeline: {m} micro-batches do not divide the batch of {batch}")
    micro = micro_slices(args, kwargs, batch, m)[0]
    margs = tuple(micro[f"input:{i}"] for i in range(len(args)))
    graph = capture(model, margs, {k: micro[k] for k in kwargs}, training=plan.training)
    refuse_buffer_updates(graph, "autopar pipeline")
    fingerprint_check(graph)
    dmesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    stage_mesh = dmesh[tuple(others)]
    coords = tuple(int(c) for c in stage_mesh.get_coordinate())
    program = lower(graph, coords)
    # random ops (dropout): rank 0's seed on every rank; each micro-batch draws its block of the whole batch's draw
    share_seed(program)
    pipelined_random(program, graph, m, batch // m)
    # the local shapes of every value: one run of this rank's program with no communication
    values = []
    for slot in program.inputs:
        if slot.kind == "param":
            values.append(local_block(model.get_parameter(slot.key).detach(), slot.placements, program.mesh_shape,
                                      coords, slot.spec.blocks))
        elif slot.kind == "buffer":
            values.append(local_block(model.get_buffer(slot.key), slot.placements, program.mesh_shape, coords,
                                      slot.spec.blocks))
        else:
            v = margs[int(slot.key.split(":")[1])] if slot.key.startswith("input:") else micro[slot.key]
            values.append(local_block(v, slot.placements, program.mesh_shape, coords, slot.spec.blocks))
    dry_run(program, values)
    stage_of = stage_rule(graph, pl["stages"])
    pp_rank = int(dmesh.get_coordinate()[names.index(pl["axis"])])
    cutting = cut(program, stage_of, len(pl["stage_ranks"]),
                  [s for s, r in enumerate(pl["stage_ranks"]) if int(r) == pp_rank],
                  split=pl["schedule"] == "ZBVZeroBubble")
    # the rank holds only the parameters its stages read (others' copies would go stale): runtime.pipeline_state
    frozen = {fqn for fqn in graph.params if not model.get_parameter(fqn).requires_grad}
    held = held_params(forward_readers(graph, stage_of), pl["stage_ranks"], pp_rank, frozen)
    drop_parameters(model, lambda fqn: graph.aliases.get(fqn, fqn) in held)
    distribute_state(model, graph, program, stage_mesh, None, materializer)
    if any(slot.spec.blocks for slot in program.inputs):  # _StridedShard parameters: teach DCP their pieces
        install_strided_checkpointing()
    groups = single_worker_gloo_groups(dmesh.mesh, dist.get_rank())
    stage_groups = [g for n, g in zip(names, groups) if n != pl["axis"]]
    return MeshPipelinedModule(model, plan, graph, stage_of, program, cutting, dmesh, stage_mesh, stage_groups, batch)


__all__ = ["build_pipelined"]
