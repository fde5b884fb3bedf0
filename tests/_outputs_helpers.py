"""Models that return more than a loss, and the function gloo ranks run on them (tests/test_outputs.py).
A module of its own so spawned workers can import it."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 8


@dataclasses.dataclass
class Out:
    """A dataclass output (not a Hugging Face ModelOutput): loss, logits and a field left None."""

    loss: torch.Tensor
    logits: torch.Tensor
    note: Optional[str] = None


class Classifier(nn.Module):
    """Two linear layers; ``returns`` picks the output: "tuple" ``(loss, accuracy)``, "dict"
    ``{"loss", "logits", "acc", "n", "again"}`` (the loss, detached), "dataclass" ``Out``, "logits" the logits alone."""

    def __init__(self, returns: str, d: int = 16, h: int = 32):
        super().__init__()
        self.returns = returns
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, CLASSES)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        if self.returns == "logits":
            return logits
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        if self.returns == "tuple":
            return loss, acc
        if self.returns == "dict":
            return {"loss": loss, "logits": logits, "acc": acc, "n": 3, "again": loss.detach()}
        return Out(loss, logits)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The ``loss_fn`` of the tests: mean cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def build(returns: str, batch: int = 8):
    """``(model, (x, y))``, the same on every process."""
    torch.manual_seed(0)
    model = Classifier(returns)
    return model, (torch.randn(batch, 16), torch.randint(0, CLASSES, (batch,)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def outputs_on_rank(text: str) -> dict:
    """Under the plan in ``text``: a dict-returning model's compiled step gives its dict (loss to
    backward, logits as a DTensor placed as the plan says, accuracy, the constant; with
    ``outputs="local"`` the logits are this rank's block as a plain tensor), and a
    logits-returning model with ``loss_fn`` and ``outputs="full"`` gives ``StepOutput`` with whole
    logits; each against the single-device model."""
    from torch.distributed.tensor import DTensor

    import autopar

    plan = autopar.Plan.from_dict(json.loads(text))
    mesh = autopar.Mesh(dict(zip(plan.axis_names, plan.mesh_shape)), device="cpu")
    res: dict = {}

    model, (x, y) = build("dict")
    ref, _ = build("dict")
    want = ref(x, y)
    want["loss"].backward()
    pm = autopar.compile(model, mesh, (x, y), plan=plan)
    out = pm(x, y)
    out["loss"].backward()
    res["dict_type"] = type(out).__name__
    res["keys"] = list(out)
    res["n"] = out["n"]
    res["logits_is_dtensor"] = isinstance(out["logits"], DTensor)
    res["logits_placements"] = [str(p) for p in out["logits"].placements] if res["logits_is_dtensor"] else None
    res["loss"] = _rel(out["loss"], want["loss"])
    res["logits"] = _rel(out["logits"].full_tensor(), want["logits"])
    res["acc"] = _rel(out["acc"].full_tensor(), want["acc"])
    res["again"] = _rel(out["again"].full_tensor(), want["loss"])
    res["grads"] = max(_rel(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad)
                       for n, p in pm.named_parameters())
    again, _ = build("dict")
    local = autopar.compile(again, mesh, (x, y), plan=plan, outputs="local")(x, y)["logits"]
    res["local_is_block"] = type(local) is torch.Tensor and torch.equal(local, out["logits"].to_local())

    model, (x, y) = build("logits")
    ref, _ = build("logits")
    logits = ref(x)
    cross_entropy(logits, y).backward()
    pm = autopar.compile(model, mesh, (x,), {"target": y}, loss_fn=cross_entropy, outputs="full",
                         deterministic_time=0.2)
    step = pm(x, target=y)
    loss, output = step  # StepOutput unpacks as a pair
    loss.backward()
    res["step_type"] = type(step).__name__
    res["full_is_plain"] = type(output) is torch.Tensor
    res["fn_loss"] = _rel(step.loss, cross_entropy(logits, y))
    res["fn_logits"] = _rel(output, logits)
    res["fn_grads"] = max(_rel(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad)
                          for n, p in pm.named_parameters())
    return res
