"""Shared pieces of the parity tests (simulate and gloo): the cases, their plans, and the function
every gloo rank runs. A module of its own so spawned workers can import it."""

from __future__ import annotations

import functools
import json

import torch

#: Float64 for the MoE: top-k routing ties cannot flip there.
FLOAT64 = ("moe",)
#: AdamW's eps: with the default 1e-8, gradients that are zero in exact arithmetic (the attention
#: key bias: softmax ignores a shift of every score) turn their roundoff into +-lr steps, which no
#: two correct implementations reproduce alike.
EPS = 1e-6
STEPS = 3


def build(family: str):
    """``(model, example_inputs)``, the same on every process."""
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make(family, "tiny", batch=8)
    if family in FLOAT64:
        model = model.double()
        args = tuple(a.double() if a.is_floating_point() else a for a in args)
    return model, args


@functools.lru_cache(maxsize=None)
def plan_json(family: str, axes: tuple, recipe: str | None = None, precision: str | None = None) -> str:
    """The plan of one case (searched, or a recipe forced), as JSON; cached per test session.
    ``precision``: the plan's (default: fp64 for ``FLOAT64`` families, else the cpu preset's fp32)."""
    import autopar

    model, args = build(family)
    mesh = autopar.Mesh(dict(axes), device="cpu")
    kw = {"precision": "fp64"} if family in FLOAT64 else {}
    if precision is not None:
        kw = {"precision": precision}
    if recipe:
        plan = getattr(autopar.recipes, recipe)(model, mesh, args, **kw)
    else:
        plan = autopar.plan(model, mesh, args, deterministic_time=0.5, progress=False, **kw)
    return plan.to_json()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    d = (a - b).norm().item()
    n = b.norm().item()
    return d / n if n > 0 else d


def simulated_errors(model, plan, args, **kw) -> tuple[float, dict[str, float]]:
    """The simulator's loss and gradients under ``plan`` against the model's own on one device:
    ``(relative loss error, {parameter name: relative gradient error})``; ``kw`` goes to
    ``autopar.simulate`` (e.g. ``trace=``)."""
    import autopar

    loss, grads = autopar.simulate(model, plan, args, **kw)
    ref = model(*args)
    ref.backward()
    return rel(loss, ref.detach()), {name: rel(grads[name], p.grad) for name, p in model.named_parameters()}


def train_on_rank(family: str, axes: tuple, text: str) -> dict:
    """On every gloo rank: compile ``family`` under the plan, train ``STEPS`` AdamW steps next to
    the single-device model and report the worst relative errors and the collectives that ran."""
    import autopar
    from autopar.runtime.accounting import differences

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build(family)
    ref, _ = build(family)
    mesh = autopar.Mesh(dict(axes), device="cpu")
    pm = autopar.compile(model, mesh, args, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=EPS)
    refp = dict(ref.named_parameters())
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0, "differences": None}
    for step in range(STEPS):
        with pm.record_collectives() as ran:
            loss = pm(*args)
            loss.backward()
        if step == 0:
            out["differences"] = differences(plan, ran)
        r = ref(*args)
        r.backward()
        out["loss"] = max(out["loss"], rel(loss, r))
        for name, p in pm.module.named_parameters():
            out["grad"] = max(out["grad"], rel(p.grad.full_tensor(), refp[name].grad))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    for name, p in pm.module.named_parameters():
        out["param"] = max(out["param"], rel(p.full_tensor(), refp[name]))
    return out


def bf16_reference(model, args) -> tuple[torch.Tensor, dict]:
    """The model with bf16 weights and inputs, its loss taken in fp32 from its bf16 ``logits``: what
    a "bf16-mixed" program computes on one device."""
    import copy

    import torch.nn.functional as F

    m = copy.deepcopy(model).to(torch.bfloat16)
    x = args[0].to(torch.bfloat16) if args[0].is_floating_point() else args[0]
    logits = m.logits(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), args[1].reshape(-1))
    loss.backward()
    return loss, {n: p.grad for n, p in m.named_parameters()}


def flat(grads: dict, names) -> torch.Tensor:
    """Every gradient in ``names`` order, as one float64 vector."""
    return torch.cat([grads[n].detach().double().flatten() for n in names])


def mixed_step_on_rank(family: str, axes: tuple, text: str) -> dict:
    """On every gloo rank: compile ``family`` under a mixed-precision plan (``compile`` runs the plan's
    precision), take one step and report the loss's and all gradients' relative errors against the
    fp32 and the bf16 single-device models, the dtypes, and the collectives that ran."""
    import autopar
    from autopar.runtime.accounting import differences

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build(family)
    ref, _ = build(family)
    pm = autopar.compile(model, autopar.Mesh(dict(axes), device="cpu"), args, plan=plan)
    with pm.record_collectives() as ran:
        loss = pm(*args)
        loss.backward()
    r = ref(*args)
    r.backward()
    names = [n for n, _ in ref.named_parameters()]
    ours = {n: p.grad.full_tensor() for n, p in pm.module.named_parameters()}
    loss16, grads16 = bf16_reference(ref, args)
    out = {"precision": pm.precision, "loss32": rel(loss, r), "loss16": rel(loss, loss16),
           "grad32": rel(flat(ours, names), flat({n: p.grad for n, p in ref.named_parameters()}, names)),
           "grad16": rel(flat(ours, names), flat(grads16, names)),
           "dtypes": sorted({str(loss.dtype)} | {str(p.dtype) for p in pm.parameters()} | {str(g.dtype) for g in ours.values()}),
           "differences": differences(plan, ran)}
    torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=EPS).step()  # the optimizer updates the fp32 DTensors
    out["dtypes_after_step"] = sorted({str(p.dtype) for p in pm.parameters()})
    return out


def inference_on_rank(text: str) -> dict:
    """An inference plan (``training=False``): the output is a DTensor equal to the model's, whether
    the input comes whole or as a DTensor already placed as the plan wants."""
    import autopar
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autopar.ir.placement import parse, to_dtensor

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build("mlp")
    ref, _ = build("mlp")
    with torch.no_grad():
        want = ref(*args)
    mesh = autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu")
    pm = autopar.compile(model, mesh, args, plan=plan)
    out = pm(*args)
    placed = distribute_tensor(args[0], pm.device_mesh, to_dtensor(parse(plan.placements["input:0"])))
    again = pm(placed, args[1])
    return {"is_dtensor": isinstance(out, DTensor), "err": rel(out.full_tensor(), want),
            "same": torch.equal(out.full_tensor(), again.full_tensor()), "input": plan.placements["input:0"]}


def mismatched_shapes_on_rank() -> str:
    """Ranks that compile with different example shapes must all fail with one clear error."""
    import torch.distributed as dist

    import autopar
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("mlp", "tiny", batch=8 if dist.get_rank() != 1 else 4)
    try:
        autopar.compile(model, autopar.Mesh({"a": 4}, device="cpu"), args, deterministic_time=0.2)
    except autopar.AutoparError as e:
        return str(e)
    return "no error"


def grad_paths_on_rank(text: str) -> dict:
    """Every way to ask for gradients gives the single-device ones, where autograd would put them:
    ``backward()`` twice accumulates, ``autograd.grad`` returns them and leaves ``.grad`` alone,
    ``backward(inputs=...)`` fills only those, a tensor hook changes what is stored and a
    post-accumulate-grad hook sees it."""
    import autopar

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build("mlp")
    ref, _ = build("mlp")
    ref(*args).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    mesh = autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu")
    pm = autopar.compile(model, mesh, args, plan=plan)
    params = dict(pm.module.named_parameters())
    names = sorted(params)
    err = {}

    def worst(got: dict, scale: float = 1.0) -> float:
        return max(rel(got[n].full_tensor(), scale * want[n]) for n in got)

    pm(*args).backward()
    pm(*args).backward()
    err["accumulated"] = worst({n: p.grad for n, p in params.items()}, 2.0)
    for p in params.values():
        p.grad = None
    got = torch.autograd.grad(pm(*args), [params[n] for n in names])
    err["autograd_grad"] = worst(dict(zip(names, got)))
    err["autograd_grad_left_grad"] = any(p.grad is not None for p in params.values())
    pm(*args).backward(inputs=[params[names[0]]])
    err["inputs_only"] = [n for n in names if params[n].grad is not None] == [names[0]]
    err["inputs_grad"] = worst({names[0]: params[names[0]].grad})
    for p in params.values():
        p.grad = None
    seen = []
    params[names[1]].register_hook(lambda g: g * 3)
    params[names[2]].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    pm(*args).backward()
    err["hooked"] = rel(params[names[1]].grad.full_tensor(), 3 * want[names[1]])
    err["post_hook_saw_grad"] = seen == [True]
    err["others"] = worst({n: params[n].grad for n in names if n != names[1]})
    # a gradient still held when the next backward runs keeps its values (buckets reuse their
    # buffer only once nothing views it)
    held = {n: params[n].grad for n in names}
    before = {n: g.full_tensor().clone() for n, g in held.items()}
    for p in params.values():
        p.grad = None
    pm(args[0] * 2, *args[1:]).backward()
    err["held_kept"] = all(torch.equal(held[n].full_tensor(), before[n]) for n in names)
    err["held_differs"] = any(not torch.equal(params[n].grad.full_tensor(), before[n]) for n in names)
    return err


def state_dict_on_rank(text: str) -> dict:
    """``pmodel.state_dict()`` keys are the single-device model's (no ``module.`` prefix): another
    single-device model's state dict loads by name into the ParallelModule (each rank cutting its
    blocks), trains on from there like that model, and its state loads back into a plain model."""
    import autopar

    plan = autopar.Plan.from_dict(json.loads(text))
    model, args = build("gpt")
    ref, _ = build("gpt")
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-1.5).add_(0.01)  # other values than the compiled model's
    mesh = autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu")
    seen: list = []  # the model's own state_dict hooks run when the ParallelModule's state_dict is asked for
    model.register_state_dict_post_hook(lambda module, sd, prefix, meta: seen.append(type(module).__name__))
    pm = autopar.compile(model, mesh, args, plan=plan)
    out = {"keys": sorted(pm.state_dict()), "ref_keys": sorted(ref.state_dict()),
           "hook_ran": list(seen),
           "param_names": [n for n, _ in pm.named_parameters()],
           "ref_param_names": [n for n, _ in ref.named_parameters()]}
    result = pm.load_state_dict(ref.state_dict())
    out["missing"], out["unexpected"] = list(result.missing_keys), list(result.unexpected_keys)
    sd = pm.state_dict()
    want = ref.state_dict()
    out["loaded_err"] = max(rel(v.full_tensor(), want[k]) for k, v in sd.items())
    out["tied"] = pm.module.lm_head.weight is pm.module.wte.weight
    out["loss_err"] = rel(pm(*args), ref(*args))
    back, _ = build("gpt")
    back.load_state_dict({k: v.full_tensor() for k, v in pm.state_dict().items()})
    out["back_err"] = max(rel(v, want[k]) for k, v in back.state_dict().items())
    try:
        pm.load_state_dict({"ln_f.weight": torch.zeros(3)}, strict=False)
        out["shape_error"] = None
    except autopar.AutoparError as e:
        out["shape_error"] = str(e)
    pm.eval()
    out["eval"] = (pm.training, pm.module.training, pm.module.wte.training)
    pm.train()
    out["train"] = (pm.training, pm.module.training, pm.module.wte.training)
    out["steps_child"] = _steps_named_child_trains(mesh)
    return out


class _StepsNamed(torch.nn.Module):
    """A model whose child is called ``steps``, like the ParallelModule's step counter."""

    def __init__(self):
        super().__init__()
        self.steps = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.steps(x).pow(2).mean()


def _steps_named_child_trains(mesh) -> tuple:
    """Two forward calls of a compiled model with a child named ``steps``: (the counter, the child's type)."""
    import autopar

    torch.manual_seed(0)
    pm = autopar.compile(_StepsNamed(), mesh, (torch.randn(8, 8),), training=True)
    for _ in range(2):
        pm(torch.randn(8, 8)).backward()
    return pm.steps, type(pm.module.steps).__name__


def devices_mesh_on_rank(text: str) -> dict:
    """On every gloo rank: compile the MLP on ``Mesh.devices(4)``, once planning there and once with the plan
    ``text`` that ``autopar.plan`` made for that mesh; per way, the mesh it runs on and the loss's and the
    gradients' worst relative errors against one device."""
    import autopar

    out = {}
    for way, plan, kw in (("planned", None, {"deterministic_time": 0.5, "progress": False}),
                          ("given", autopar.Plan.from_dict(json.loads(text)), {})):
        model, args = build("mlp")
        ref, _ = build("mlp")
        pm = autopar.compile(model, autopar.Mesh.devices(4, device="cpu"), args, plan=plan, **kw)
        loss = pm(*args)
        loss.backward()
        r = ref(*args)
        r.backward()
        refp = dict(ref.named_parameters())
        grad = max(rel(p.grad.full_tensor(), refp[name].grad) for name, p in pm.module.named_parameters())
        out[way] = {"mesh": dict(zip(pm.device_mesh.mesh_dim_names, pm.device_mesh.mesh.shape)),
                    "loss": rel(loss, r), "grad": grad}
    return out
