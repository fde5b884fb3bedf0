"""What gloo ranks run in tests/test_dropout.py (spawned pool workers import this module; it
imports only torch at module level)."""

from __future__ import annotations

import functools
import json
import warnings

import torch

#: The dropout probability of the test models: high, so a wrong mask shows in the loss.
P = 0.3


def build_gpt(dtype=torch.float64):
    """autopar's tiny GPT with dropout everywhere (embeddings, attention, residuals, MLP)."""
    from autopar.models import make

    torch.manual_seed(0)
    return make("gpt", "tiny", batch=4, seq=16, dtype=dtype, dropout=P)


def train_and_restore_on_rank(text: str, seed: int, grads: dict, ckpt_dir: str) -> dict:
    """Compile the dropout GPT under plan ``text`` after ``torch.manual_seed(seed)``; report the
    first step's loss and the worst relative error of its gradients against ``grads``, the
    ``state_dict``'s random entry after two SGD steps, and the third step's loss from the trained
    module and from a fresh module (other seed, other weights) that loaded its state dict through
    ``torch.distributed.checkpoint`` (saved to ``ckpt_dir``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.parallel import RANDOM_KEY

    plan = autopar.Plan.from_dict(json.loads(text))
    mesh = autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu")
    model, args = build_gpt()
    torch.manual_seed(seed)
    pm = autopar.compile(model, mesh, args, plan=plan)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    out: dict = {"losses": []}
    for step in range(2):
        loss = pm(*args)
        loss.backward()
        if step == 0:
            out["grad"] = max(((p.grad.full_tensor() - grads[n]).norm() / grads[n].norm()).item()
                              for n, p in pm.module.named_parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    state = pm.state_dict()
    out["random_is_dtensor"] = isinstance(state[RANDOM_KEY], DTensor)
    out["random"] = state[RANDOM_KEY].full_tensor().tolist()
    dcp.save(state, checkpoint_id=ckpt_dir)
    out["next"] = pm(*args).item()
    other, _ = build_gpt()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    torch.manual_seed(seed + 1)
    pm2 = autopar.compile(other, mesh, args, plan=plan)
    out["other_random"] = pm2.state_dict()[RANDOM_KEY].full_tensor().tolist()
    target = pm2.state_dict()
    dcp.load(target, checkpoint_id=ckpt_dir)
    pm2.load_state_dict(target)
    out["restored_random"] = pm2.state_dict()[RANDOM_KEY].full_tensor().tolist()
    out["restored_next"] = pm2(*args).item()
    return out


def corpus_step_on_rank(cases: list, seed: int) -> dict:
    """For each ``(name, plan JSON)`` of ``cases``: compile corpus model ``name`` (dropout on,
    float64) under the plan after ``torch.manual_seed(seed)``, take one forward and backward, and
    report the loss and every whole gradient; and the loss of a second forward with the same
    weights (the next step's masks)."""
    import autopar
    from _corpus import build  # the parent's tests/ is on the workers' sys.path

    out = {}
    for name, text in cases:
        plan = autopar.Plan.from_dict(json.loads(text))
        model, args, kwargs = build(name, dropout=True, dtype=torch.float64)
        torch.manual_seed(seed)
        pm = autopar.compile(model, autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu"), args,
                             kwargs, plan=plan)
        loss = _loss(pm(*args, **kwargs))  # a Hugging Face model returns its ModelOutput
        loss.backward()
        out[name] = (loss.item(), {n: p.grad.full_tensor()  # tied weights under each of their names
                                   for n, p in pm.module.named_parameters(remove_duplicate=False)
                                   if p.grad is not None})
        with torch.no_grad():
            out[name + ":next"] = _loss(pm(*args, **kwargs)).item()
    return out


def _loss(out):
    """The loss of what a compiled step returns: the tensor itself, or a ``ModelOutput``'s ``loss``."""
    return out if isinstance(out, torch.Tensor) else out.loss


#: The run's seed of the corpus programs below (simulate and compile draw it from torch's generator).
SEED = 5


@functools.lru_cache(maxsize=None)
def corpus_programs(name: str) -> tuple:
    """Corpus model ``name`` with dropout on, in float64: ``(graph, 1-device plan, (2, 2) fsdp_tp
    plan, the 1-device program's (loss, gradients) with seed ``SEED``)``; made once per process, one
    capture for both plans and the simulations (capture draws nothing from torch's generator)."""
    import autopar
    from _corpus import build
    from autopar.ir.capture import capture

    model, args, kwargs = build(name, dropout=True, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # T5's learned-bias attention runs unfused: warned
        graph = capture(model, args, kwargs)
        one = autopar.plan(model, autopar.Mesh({"a": 1}, device="cpu"), args, kwargs, graph=graph,
                           precision="fp64", search="propagate", progress=False)
        many = autopar.recipes.fsdp_tp(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args, kwargs,
                                       graph=graph, precision="fp64", progress=False)
        torch.manual_seed(SEED)
        return graph, one, many, autopar.simulate(model, one, args, kwargs, graph=graph)


def close(got: tuple, want: tuple, tol: float, label) -> None:
    """Loss and all gradients (as one vector) of ``got`` within ``tol`` of ``want``'s, relative."""
    (loss, grads), (ref, ref_grads) = got, want
    assert abs(float(loss) - float(ref)) <= tol * abs(float(ref)), (label, float(loss), float(ref))
    assert grads.keys() == ref_grads.keys(), label
    names = sorted(ref_grads)
    a = torch.cat([grads[n].double().flatten() for n in names])
    b = torch.cat([ref_grads[n].double().flatten() for n in names])
    # one vector: gradients zero in exact arithmetic (attention's key bias) are roundoff alone
    assert (a - b).norm().item() <= tol * b.norm().item(), (label, (a - b).norm().item() / b.norm().item())


def pipelined_dropout_step_on_rank(text: str, seed: int, dtype=torch.float32) -> dict:
    """Compile the 4-layer dropout GPT (``tests/test_pipeline_random.py``) under pipelined plan ``text``
    after ``torch.manual_seed(seed)`` (rank 0's seed is shared); one step: its loss, the gradients this
    rank holds (whole), what differs from the predicted collectives, then the step the next draw uses,
    the ``RANDOM_KEY`` entry of its ``state_dict`` and the step after loading one that says 5."""
    import autopar
    from autopar.models import make

    plan = autopar.Plan.from_dict(json.loads(text))
    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=4, seq=16, dropout=P, n_layer=4, dtype=dtype)
    torch.manual_seed(seed)
    mesh = autopar.Mesh(dict(zip(plan.pipeline.mesh_names, plan.pipeline.mesh_shape)), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, mesh, args, plan=plan)
    with pm.record_collectives() as ran:
        loss = pm(*args)
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    from autopar.parallel import RANDOM_KEY

    step = pm.program.random.step
    state = pm.state_dict()  # seed and next step travel with the state (a resumed run draws on)
    saved = state[RANDOM_KEY].full_tensor().tolist()
    state[RANDOM_KEY] = torch.tensor([saved[0], 5])
    pm.load_state_dict(state)
    return {"loss": loss.item(), "dtype": str(loss.dtype), "grads": grads, "differences": pm.differences(ran), "step": step,
            "saved": saved, "loaded_step": pm.program.random.step}


def dropout_model(name: str, dtype=torch.float64):
    """``(model, args, kwargs)``: the 4-layer dropout GPT of ``tests/test_pipeline_random.py``
    (``"gpt"``) or corpus model ``name`` with dropout, in ``dtype``, fixed weights."""
    if name == "gpt":
        from autopar.models import make

        torch.manual_seed(0)
        model, args = make("gpt", "tiny", batch=4, seq=16, dtype=dtype, dropout=P, n_layer=4)
        return model, args, {}
    from _corpus import build

    return build(name, dropout=True, dtype=dtype, layers=4)  # ZBV: two stages per rank


def pp_alone_dropout_step_on_rank(cases: list, seed: int) -> list:
    """Per ``(model name, plan text)``: compile the dropout model under the pipelined plan of the pp
    axis alone (``runtime.pipeline``) after ``torch.manual_seed(seed)``; one step: its loss and
    dtype, the gradients this rank holds, then the step the next draw uses, the ``RANDOM_KEY`` entry
    of its ``state_dict`` and the step after loading one that says 5."""
    import autopar
    from autopar.parallel import RANDOM_KEY

    out = []
    for name, text in cases:
        plan = autopar.Plan.from_dict(json.loads(text))
        model, args, kwargs = dropout_model(name)
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, autopar.Mesh({"pp": 2}, device="cpu"), args, kwargs, plan=plan)
        loss = pm(*args, **kwargs)
        loss.backward()
        state = pm.state_dict()
        saved = state[RANDOM_KEY].tolist()
        state[RANDOM_KEY] = torch.tensor([saved[0], 5])
        pm.load_state_dict(state)
        out.append({"loss": loss.item(), "dtype": str(loss.dtype), "saved": saved, "loaded_step": pm.random.step,
                    "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}})
    return out
