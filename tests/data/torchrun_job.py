"""One rank of a two-node torchrun job (tests/test_torchrun.py): the script calls ``autopar.compile``
without starting a process group, trains two steps on a dp=2 x tp=2 mesh whose tp groups stay on a
node, and rank 0 writes the losses, its group's backend and any warning to the file in argv[1]."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar.models import make

torch.manual_seed(0)
model, inputs = make("gpt", "tiny", batch=4)
mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu", devices_per_node=2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pm = autopar.compile(model, mesh, inputs)
opt = torch.optim.SGD(pm.parameters(), lr=0.1)
losses = []
for _ in range(2):
    loss = pm(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump({"losses": losses, "backend": dist.get_backend(), "world": dist.get_world_size(),
                   "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                   "node": os.environ.get("GROUP_RANK")}, fh)
dist.destroy_process_group()
