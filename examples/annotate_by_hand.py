"""Annotate a model by hand: three ways to pin placements, all hard constraints for the search.

1. ``autopar.hint(x, "tp=S(1)")`` inside ``forward`` pins an activation;
2. ``hints={"path.*.weight": "S(0), B", "input:0": "dp=S(0)"}`` pins parameters (``*`` wildcards)
   and inputs by name;
3. a parameter or example input that already is a ``DTensor`` keeps its placements.

The search places everything else; ``plan.explain(module)`` shows what it chose around the pins.

    python examples/annotate_by_hand.py
"""

from __future__ import annotations

import torch
from torch import nn

import autopar


class Block(nn.Module):
    """An MLP block whose hidden activation we want split along the tensor-parallel axis."""

    def __init__(self, dim: int = 256, hidden: int = 1024):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        h = torch.relu(self.up(x))
        h = autopar.hint(h, "tp=S(1)")  # 1. the hidden features split across tp (Megatron's column split)
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return ((x - y) ** 2).mean()


def main() -> autopar.Plan:
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    mesh = autopar.Mesh({"dp": 2, "tp": 4}, device="h100")
    hints = {
        "input:0": "dp=S(0)",                    # 2. the batch split across dp
        "blocks.*.down.weight": "tp=S(1)",        #    row-parallel second matmul
    }
    plan = autopar.plan(model, mesh, (x, y), hints=hints)
    for name in ("blocks.0.up.weight", "blocks.0.down.weight", "input:0"):
        print(f"{name:22s} {plan.placements[name]}")
    print()
    print(plan.explain("blocks.0"))
    return plan


if __name__ == "__main__":
    main()
