"""The process groups lowered programs run their collectives on, under gloo: groups of their own,
one per mesh axis, each with a single gloo worker thread. torch 2.13's gloo backend corrupts the
heap when two collectives of one group finish together on its two workers (see
``autopar.runtime.collectives.single_worker_gloo_groups``), and programs keep several in flight."""

from __future__ import annotations

import pytest
import torch

from _gloo_helpers import program_groups_on_rank
from _parity import plan_json

#: the launch's timeout (s): about 3x the 56 s it took under load; it is every group's timeout too
TIMEOUT = 180


def test_axis_groups_lists_every_group_along_each_axis():
    from autopar.runtime.collectives import axis_groups

    ranks = torch.arange(6).reshape(2, 3)
    assert axis_groups(ranks) == [[[0, 3], [1, 4], [2, 5]], [[0, 1, 2], [3, 4, 5]]]
    assert axis_groups(torch.arange(4)) == [[[0, 1, 2, 3]]]


@pytest.mark.gloo
@pytest.mark.slow
def test_programs_collectives_run_on_single_worker_gloo_groups():
    import autopar

    flat_case = ((("a", 4),), plan_json("mlp", (("a", 4),), "ddp"))
    cases = [flat_case, ((("a", 2), ("b", 2)), plan_json("mlp", (("a", 2), ("b", 2)), "fsdp")), flat_case]
    results = autopar.launch(program_groups_on_rank, 4, cases, timeout=TIMEOUT, collective_timeout=TIMEOUT)
    for rank, per_case in enumerate(results):
        flat, square, again = per_case
        # a later program on the same mesh reuses the groups rather than making new ones
        assert [g["name"] for g in again["groups"]] == [g["name"] for g in flat["groups"]], (rank, per_case)
        assert flat["grads"] and square["grads"], (rank, per_case)
        # mesh (4,): one group of all four ranks, but not the default group its user made
        assert [g["ranks"] for g in flat["groups"]] == [[0, 1, 2, 3]], (rank, flat)
        assert not flat["groups"][0]["world"], (rank, flat)
        # mesh (2, 2): rank r sits at (r // 2, r % 2)
        a, b = divmod(rank, 2)
        assert [g["ranks"] for g in square["groups"]] == [[b, 2 + b], [2 * a, 2 * a + 1]], (rank, square)
        for g in flat["groups"] + square["groups"]:
            assert g["threads"] == 1, (rank, g)
            # launch's timeout, not gloo's default: a rank that stops fails the others alike
            assert g["timeout"] == flat["world_timeout"] == TIMEOUT, (rank, g, flat["world_timeout"])
