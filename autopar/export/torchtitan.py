"""The ``torchtitan`` export: the ``[parallelism]`` and ``[activation_checkpoint]`` settings of
torchtitan's job config that reproduce a plan's projection (``export.project.Styles``), as a dict
and as the TOML fragment to paste into a job config."""

from __future__ import annotations

import math
import re
from typing import Optional

from autopar.export.project import Styles
from autopar.plans.schema import Plan

#: module paths of torchtitan's Llama (and its relatives): the layer stack and the projections
_TITAN = (re.compile(r"(^|\.)layers\.\d+\.attention\.w[qkvo]$"),
          re.compile(r"(^|\.)layers\.\d+\.feed_forward\.w[123]$"),
          re.compile(r"(^|\.)tok_embeddings$"), re.compile(r"(^|\.)output$"))


def titan_shaped(plan: Plan) -> Optional[str]:
    """None when the plan's model has torchtitan's Llama module paths (``tok_embeddings``,
    ``layers.N.attention.wq``, ``layers.N.feed_forward.w1``, ``output``); else why not."""
    paths = {m.get("path", "") for m in plan.modules}
    if not all(any(r.search(p) for p in paths) for r in _TITAN):
        return ("the model's module paths are not torchtitan's Llama (tok_embeddings, layers.N.attention.wq, "
                "layers.N.feed_forward.w1, output): the degrees below apply only to a torchtitan model")
    return None


def _batch(plan: Plan) -> int:
    """The first input's batch in the plan's graph (0: not known)."""
    shape = plan.graph.get("inputs", {}).get("input:0", "")
    m = re.search(r"\[(\d+)", shape)
    return int(m.group(1)) if m else 0


def _checkpointing(st: Styles, layers: int) -> tuple[dict, list[str]]:
    """torchtitan's ``[activation_checkpoint]`` for the recomputed layers, and what it cannot say."""
    done = st.checkpointed
    if not done:
        return {"mode": "none"}, []
    modes = set(done.values())
    if len(done) == layers and modes == {"full"}:
        return {"mode": "full"}, []
    if modes == {"selective"} and len(done) == layers:
        return {"mode": "selective", "selective_ac_option": "op"}, []
    index = sorted(int(m.group(1)) for p in done for m in [re.search(r"(\d+)$", p)] if m)
    every = index[1] - index[0] if len(index) > 1 else layers
    notes = []
    if index != list(range(every - 1, layers, every)) or modes != {"full"}:
        notes.append(f"torchtitan recomputes every N-th layer; the plan recomputes {sorted(done)} "
                     f"({', '.join(sorted(modes))}): every {every}-th layer is the nearest")
    return {"mode": "selective", "selective_ac_option": str(every)}, notes


def settings(plan: Plan, st: Styles) -> tuple[dict, list[str]]:
    """``({section: {key: value}}, notes)``: the job config's settings and what they cannot reproduce."""
    axes = dict(zip(plan.axis_names, plan.mesh_shape))
    data = [axes[a] for a in st.data_axes]
    par = {
        "data_parallel_replicate_degree": math.prod(data[:-1]) if data else 1,
        "data_parallel_shard_degree": data[-1] if data else 1,
        "tensor_parallel_degree": axes[st.tensor_axis] if st.tensor_axis else 1,
        "context_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
    }
    notes = []
    pipe = plan.pipeline
    if pipe is not None:
        par.update(pipeline_parallel_degree=pipe.degree, pipeline_parallel_schedule=pipe.schedule,
                   module_fqns_per_model_part=[list(s) for s in pipe.stages])
        # the plan's graph is one micro-batch's: its batch over the data ranks is a rank's micro-batch
        batch = _batch(plan)
        pieces = math.prod(data) if data else 1
        if batch and batch % pieces == 0:
            par["pipeline_parallel_microbatch_size"] = batch // pieces
        notes.append(f"{pipe.microbatches} micro-batches: training.local_batch_size = "
                     f"{pipe.microbatches} x pipeline_parallel_microbatch_size")
    if st.tensor_axis is not None:
        notes.append("torchtitan's tensor parallelism splits every attention and MLP projection, with "
                     f"sequence-parallel norms; the projection splits {len(st.linear)} Linear modules")
    layers = sum(len(g.get("paths", [])) for g in plan.layer_groups)
    ac, more = _checkpointing(st, layers)
    why = titan_shaped(plan)
    return {"parallelism": par, "activation_checkpoint": ac}, notes + more + ([why] if why else [])


def toml(config: dict) -> str:
    """The settings as a TOML fragment (sections of strings, integers and lists of strings)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in section.items())
                     for name, section in config.items())


__all__ = ["settings", "titan_shaped", "toml"]
