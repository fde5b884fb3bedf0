"""What gloo ranks run in tests/test_export.py (a module of its own, so spawned ranks import it
without pytest): the exported dtensor module applied to a model, one training step, its loss,
gradients and collectives."""

from __future__ import annotations

import importlib.util
import sys

import torch


def load_module(text: str, name: str):
    """The exported module's text as an imported module (nothing of autopar in it)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    sys.modules[name] = module
    return module


def reference(model, args) -> tuple[float, dict]:
    """One device's loss and gradients of one step."""
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def build(case: str):
    """``(model, example_inputs)`` of a case, the same on every process: a tiny ``autopar.models``
    family, or ``"titan"`` (the torchtitan-style Llama 3 of tests/_corpus.py)."""
    if case != "titan":
        from _parity import build as build_family

        return build_family(case)
    from _corpus import titan_llama

    torch.manual_seed(0)
    model, args, _ = titan_llama()
    return model, args


def step_on_rank(case: str, text: str) -> dict:
    """Apply the exported layout to the ``case`` model (``build``, in float64), run one step under
    CommDebugMode; the loss averaged over the data ranks, the worst gradient error against one
    device, the collectives by kind, and how often each recomputed layer ran."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from torch.distributed.tensor.debug import CommDebugMode

    model, args = build(case)
    model, args = model.double(), tuple(a.double() if a.is_floating_point() else a for a in args)
    want_loss, want = reference(model, args)
    module = load_module(text, f"exported_{case}")
    mesh = init_device_mesh("cpu", tuple(module.MESH_AXES.values()), mesh_dim_names=tuple(module.MESH_AXES))
    model.zero_grad(set_to_none=True)
    module.parallelize(model, mesh)
    runs: dict[str, int] = {}  # per recomputed layer, how often its first child runs in the step
    for path in module.CHECKPOINTED:
        child = next(model.get_submodule(path).children())
        child.register_forward_hook(lambda *_, path=path: runs.__setitem__(path, runs.get(path, 0) + 1))
    local = tuple(module.local_batch(a, mesh) for a in args)
    with CommDebugMode() as comm:
        loss = model(*local)
        loss.backward()
    counts: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():  # c10d._allgather_base_, c10d_functional.all_reduce, ...
        name = str(op).split(".")[-1].strip("_")
        kind = {"allgather_base": "all_gather", "allreduce": "all_reduce", "reduce_scatter_base": "reduce_scatter",
                "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}.get(name, name)
        counts[kind] = counts.get(kind, 0) + n
    got = loss.detach().clone()
    dist.all_reduce(got)
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((g - want[n]).abs().max() / (want[n].abs().max() + 1e-12)))
    return {"loss": got.item() / dist.get_world_size(), "want_loss": want_loss, "grad_error": worst,
            "collectives": dict(counts), "runs": runs}


def cases_on_rank(cases: list) -> list:
    """``step_on_rank`` for each ``(case, exported text)``."""
    return [step_on_rank(case, text) for case, text in cases]
