"""The commands: one ``cmd_*`` function per ``autopar`` command, taking the parsed arguments and
returning the exit status; every expected failure is a ``CLIError``. autopar itself is imported inside
them, so ``autopar --help`` stays quick.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from autopar.cli.args import parse_hints, parse_kw, parse_mesh, parse_pipeline
from autopar.cli.errors import USAGE, CLIError
from autopar.cli.target import call_factory, exception_line, import_target, user_frame, where_raised


def cmd_plan(args: argparse.Namespace) -> int:
    """``autopar plan``: plan MODULE:FACTORY for the mesh, save the plan, print its summary."""
    if (args.mesh is None) == (args.devices is None):
        raise CLIError("autopar plan: give either --mesh NAME=SIZE,... (the axes) or --devices N (the planner chooses "
                       "the axes)", USAGE)
    if args.devices is not None and args.hint:
        raise CLIError("--hint names mesh axes, which --devices leaves to the planner: give --mesh to use hints", USAGE)
    axes = parse_mesh(args.mesh) if args.mesh is not None else {"devices": args.devices}
    kw = parse_kw(args.kw)
    hints = parse_hints(args.hint, list(axes))
    pipeline = parse_pipeline(args.pipeline) if args.pipeline else None
    out = args.output
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise CLIError(f"-o {out!r}: the directory {folder!r} does not exist; create it or write elsewhere", USAGE)
    if os.path.isdir(out):
        raise CLIError(f"-o {out!r} is a directory; give a file name such as {os.path.join(out, 'plan.json')!r}", USAGE)

    import autopar
    from autopar.cli.progress import PLAN_PHASES, Progress, is_terminal
    from autopar.errors import MeshError

    try:
        if args.devices is not None:
            mesh = autopar.Mesh.devices(args.devices, device=args.device, node_size=args.devices_per_node,
                                        profile=args.profile, nics_per_node=args.nics_per_node)
        else:
            mesh = autopar.Mesh(axes, device=args.device, profile=args.profile, devices_per_node=args.devices_per_node,
                                nics_per_node=args.nics_per_node)
    except MeshError as e:
        if args.profile and "profile" in str(e):
            raise CLIError(f"--profile {args.profile!r}: {e}") from e
        given = f"--mesh {args.mesh!r}" if args.mesh is not None else f"--devices {args.devices}"
        raise CLIError(f"{given} --device {args.device}: {e}", USAGE) from e
    name, factory, file = import_target(args.target)
    model, inputs, kwargs = call_factory(name, factory, file, kw)

    plan_kw: dict[str, Any] = dict(training=not args.inference, hints=hints or None, memory_budget=args.memory_budget,
                                   time_limit=args.time_limit)
    if args.search_time is not None:
        plan_kw["deterministic_time"] = args.search_time
    if args.recipe:
        plan_kw["recipe"] = args.recipe
    if pipeline:
        plan_kw["pipeline"] = pipeline
    what = f"planning {name} for mesh {axes} ({args.device})"
    tty = is_terminal()
    try:
        with Progress("planning", PLAN_PHASES, enabled=tty):
            plan = autopar.plan(model, mesh, inputs, kwargs or None, progress=tty, **plan_kw)
    except autopar.AutoparError as e:
        msg = str(e)
        for path in hints:  # say it in the command line's words
            msg = msg.replace(f"hints[{path!r}]", f"--hint {path}={hints[path]}")
        raise CLIError(f"{what} failed: {msg}") from e
    except Exception as e:
        user = user_frame(e)
        if user is not None:  # the model's forward (or its inputs) went wrong while being captured
            raise CLIError(f"{what} failed in the model's code at {user}: {exception_line(e)}; check that "
                           f"model(*example_inputs) runs" + ("" if args.inference else " and returns the loss")) from e
        raise CLIError(f"{what} failed: internal error {exception_line(e)} (at {where_raised(e)}); rerun with --debug "
                       f"for the traceback and report it") from e
    try:
        plan.save(out)
    except OSError as e:
        raise CLIError(f"cannot write the plan to {out!r}: {e.strerror or e}") from e
    print(plan.summary(full=args.full))
    print(f"\nsaved the plan to {out}; show it again with `autopar show {out}`, "
          f"explain a module with `autopar explain {out} MODULE_PATH`")
    return 0


def load(path: str):
    """``autopar.load_plan`` with CLI wording for the usual mistakes."""
    import autopar

    if not os.path.exists(path):
        raise CLIError(f"no plan file at {path!r}: make one with `autopar plan MODULE:FACTORY --mesh ... -o {path}`")
    try:
        return autopar.load_plan(path)
    except autopar.PlanError as e:
        raise CLIError(f"{e} (a plan file is what `autopar plan -o` or Plan.save writes)") from e
    except OSError as e:
        raise CLIError(f"cannot read the plan file {path!r}: {e.strerror or e}") from e


def cmd_show(args: argparse.Namespace) -> int:
    """``autopar show``: a saved plan's summary table, or (``--html``) its HTML page."""
    plan = load(args.plan)
    if args.html is not None:
        from autopar.plans.html import write_html

        try:
            write_html(plan, args.html)
        except OSError as e:
            raise CLIError(f"--html {args.html!r}: cannot write the page: {e.strerror or e}") from e
        print(f"wrote {args.html}")
        return 0
    print(plan.summary(full=args.full))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """``autopar explain``: one module's (or parameter's) strategies, reshardings and alternatives."""
    import autopar

    plan = load(args.plan)
    try:
        text = plan.explain(args.module_path)
    except autopar.PlanError as e:
        raise CLIError(f"{args.plan}: {e}; `autopar show {args.plan} --full` lists every module") from e
    print(text)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``autopar diff``: what differs between two saved plans."""
    a, b = load(args.a), load(args.b)
    print(a.diff(b))
    return 0


def cmd_replan(args: argparse.Namespace) -> int:
    """``autopar replan``: plan a saved plan's model again for the devices left, check the
    checkpoint against it, save the new plan and print what changed (``autopar.replan``)."""
    old = load(args.plan)
    out = args.output
    if os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise CLIError(f"-o {out!r}: give a file name in an existing directory, such as 'replanned.json'", USAGE)
    if args.checkpoint is not None and not os.path.isfile(os.path.join(args.checkpoint, ".metadata")):
        raise CLIError(f"--checkpoint {args.checkpoint!r} is not a torch.distributed.checkpoint directory (it has no "
                       f".metadata): give the directory dcp.save wrote under {args.plan}")
    kw = parse_kw(args.kw)
    import autopar
    from autopar.cli.progress import PLAN_PHASES, Progress, is_terminal

    name, factory, file = import_target(args.target)
    model, inputs, kwargs = call_factory(name, factory, file, kw)
    if args.checkpoint is not None:  # before planning: a checkpoint of another model ends it at once
        from autopar.replan import check_checkpoint

        check = check_checkpoint(model, args.checkpoint)
        if not check.loadable:
            some = [f"{n} missing" for n in check.missing[:3]] + [
                f"{n} is {ck} there, {mine} in the model" for n, (ck, mine) in list(check.mismatched.items())[:3]]
            raise CLIError(f"--checkpoint {args.checkpoint!r} does not hold {name}'s state: {len(check.missing)} "
                           f"tensors missing, {len(check.mismatched)} of another shape ({'; '.join(some)}); give the "
                           f"checkpoint saved under {args.plan}")
    plan_kw: dict[str, Any] = {"time_limit": args.time_limit}
    if args.search_time is not None:
        plan_kw["deterministic_time"] = args.search_time
    tty = is_terminal()
    try:
        with Progress("replanning", PLAN_PHASES, enabled=tty):
            again = autopar.replan(model, old, args.devices, inputs, kwargs or None, checkpoint=args.checkpoint,
                                   progress=tty, **plan_kw)
    except autopar.AutoparError as e:
        raise CLIError(f"replanning {name} ({args.plan}) for {args.devices} devices failed: {e}") from e
    try:
        again.plan.save(out)
    except OSError as e:
        raise CLIError(f"cannot write the plan to {out!r}: {e.strerror or e}") from e
    print(again.report())
    print(f"\nsaved the new plan to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``autopar demo``: see ``autopar.cli.demo``."""
    from autopar.cli.demo import demo

    return demo(quick=args.quick, train=not args.no_train, steps=args.steps)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``autopar calibrate``: measure this machine into a hardware profile."""
    from autopar.cost_model.calibrate import calibrate

    lines: list[str] = []
    hw = calibrate(args.output, nprocs=args.nprocs, quick=args.quick, report=lines)
    print(f"wrote {args.output}: {hw.name}; use it with autopar.Mesh(..., device='cpu', profile='{args.output}')")
    e = hw.efficiency
    print(f"fp32 matmul {hw.peak_flops['float32'] / 1e9:.1f} GFLOP/s (x {e.mm_max:.2f}, half at MN {e.mm_half_mn:.0f}, "
          f"K {e.mm_half_k:.0f}); attention fwd {e.attn_fwd:.2f} / bwd {e.attn_bwd:.2f} of it (half at {e.attn_half_seq:.0f} "
          f"keys); memory {hw.hbm_bandwidth / 1e9:.1f} GB/s (x {e.mem_max:.2f}, half at {e.mem_half_bytes:.0f} B); "
          f"launch floor {hw.launch_floor * 1e6:.1f} us")
    link = hw.intra_node
    if lines:
        print(f"gloo, {args.nprocs} processes, collectives between compute: latency {link.latency * 1e6:.0f} us, "
              f"bandwidth {link.bandwidth / 1e9:.2f} GB/s"
              + "".join(f", {kind} at {f:.2f}x its ring time" for kind, f in link.factors) + ", fitted to:")
        for line in lines:
            print(f"  {line}")
    return 0


__all__ = ["cmd_calibrate", "cmd_demo", "cmd_diff", "cmd_explain", "cmd_plan", "cmd_replan", "cmd_show", "load"]
