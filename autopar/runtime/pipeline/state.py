"""What a pipeline rank holds of the model's state, so that ``state_dict`` and DCP are right.

A pipeline rank updates only the parameters its stages read (their gradients reach it; the tied
embedding and head, read on two ranks, get the same summed gradient on both). A copy of any other
parameter would go stale from the first optimizer step, and a checkpoint taken with it would hold
old values for some parameters without a word (DCP keeps one of the duplicate entries of several
ranks, whichever). So the rank does not hold them: their entries in the model's parameter tables are
set to None (the ``bias=None`` form ``nn.Module`` skips in ``named_parameters``, ``state_dict`` and
DCP's ``get_state_dict``), and they are never materialised. What the rank exposes is then exactly
what it keeps up to date:

- ``named_parameters`` / ``parameters`` (what the optimizer is built on): the parameters its stages
  read, the tied ones on both ranks;
- ``state_dict``: those parameters and every buffer (a pipelined run refuses buffer updates, so
  every rank's copy is right), by the single-device names. With other mesh axes each is a DTensor on
  the rank's stage mesh (the mesh without ``pp``) placed as the plan says, so
  ``torch.distributed.checkpoint`` writes each piece once (the ranks' entries carry global offsets;
  duplicates, such as a tied weight on the first and last stages, are kept once) and reshards on
  load; with the pipeline axis alone they are whole tensors (DCP keeps one entry per name);
- ``load_state_dict`` takes a single-device state dict (every name): the entries of parameters other
  ranks hold are checked for shape and skipped.

Parameters that no stage reads or that need no gradient are never updated, so every rank keeps them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from autopar import _torch_compat as tc
from autopar.errors import ArgumentError, CompileError
from autopar.ir.stages import forward_readers


def held_params(stages: Mapping[str, set[int]], mine: set[int], frozen: set[str]) -> set[str]:
    """The parameter FQNs a pipeline rank holds: those its stages (``mine``) read, and those never
    updated anywhere (read by no stage, or ``frozen``: no gradient)."""
    return {fqn for fqn, where in stages.items() if where & mine or not where or fqn in frozen}


def local_state(mod: torch.nn.Module, name: str, kind: str, local: tuple,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """The local block of ``mod``'s parameter (``kind`` "param") or buffer ``name`` for the step's
    static program; for a parameter this rank does not hold, zeros of its ``local`` (shape, dtype)
    on ``device`` (the program's; None: the CPU), taking no memory. Such a parameter is read by no
    op of the rank's stages: the static program reads it only where the plan packs it into one
    gather with parameters the rank does read (a bucket of the embedding and the head); the
    gathered copy is unused here."""
    value = tc.parameter_table(mod)[name] if kind == "param" else tc.buffer_table(mod)[name]
    if value is not None:
        return tc.local_tensor(value)
    shape, dtype = local
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def drop_parameters(model: torch.nn.Module, keep: Callable[[str], bool]) -> dict[str, tuple]:
    """Set to None every parameter table entry (every name of it, tied ones included) of the
    parameters ``keep(FQN)`` refuses (asked once per parameter, by its first name in
    ``named_parameters``); -> name -> whole shape of each entry dropped."""
    first: dict[int, str] = {}
    for fqn, p in model.named_parameters():
        first.setdefault(id(p), fqn)
    gone = {i for i, fqn in first.items() if not keep(fqn)}
    dropped: dict[str, tuple] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        table = tc.parameter_table(mod)
        for name, p in list(table.items()):
            if p is not None and id(p) in gone:
                dropped[f"{path}.{name}" if path else name] = tuple(p.shape)
    for path, mod in model.named_modules(remove_duplicate=False):
        table = tc.parameter_table(mod)
        for name in list(table):
            if (f"{path}.{name}" if path else name) in dropped:
                table[name] = None
    return dropped


def keep_stage_parameters(model: torch.nn.Module, staged) -> dict[str, tuple]:
    """Drop the parameters the pipeline rank of ``staged`` (a ``program.staged.StagedProgram``) does
    not hold: ``held_params`` of its local stages; -> ``drop_parameters``'s."""
    graph = staged.graph
    frozen = {fqn for fqn in graph.params if not model.get_parameter(fqn).requires_grad}
    held = held_params(forward_readers(graph, staged.stage_of), set(staged.local), frozen)
    return drop_parameters(model, lambda fqn: graph.aliases.get(fqn, fqn) in held)


def without_dropped(state_dict: Mapping, dropped: Mapping[str, tuple]) -> dict:
    """``state_dict`` less the entries of parameters other pipeline ranks hold (``dropped``: name ->
    whole shape), each checked for shape: a single-device state dict loads on every rank."""
    out = {}
    for key, value in state_dict.items():
        if key in dropped:
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(dropped[key]):
                raise CompileError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, but the model's {key} has "
                                   f"{tuple(dropped[key])}")
            continue
        out[key] = value
    return tc.with_metadata(out, state_dict)


def refuse_buffer_updates(graph, where: str) -> None:
    """Refuse a model whose forward updates buffers (BatchNorm's running statistics, a step counter):
    a pipelined step runs the forward once per micro-batch, on the rank holding the op, so the updates
    would have to be applied in turn per micro-batch (the micro-batched run's, not the whole batch's)
    and kept equal where other ranks read the buffer; the pipelined runtimes do not do that yet, and
    dropping them would leave the buffers at their old values without a word."""
    if graph.mutations:
        names = sorted(graph.mutations)
        raise ArgumentError(
            f"{where}: the model updates buffer(s) {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} in its "
            "forward (BatchNorm running statistics, a step counter); a pipelined run does not apply buffer updates "
            "yet (each micro-batch would update them in turn, on the rank holding the op). Plan without a 'pp' axis "
            "(the unpipelined runtimes apply them), or stop the updates (BatchNorm: module.eval() or "
            "track_running_stats=False)")


__all__ = ["drop_parameters", "held_params", "keep_stage_parameters", "local_state", "refuse_buffer_updates",
           "without_dropped"]
