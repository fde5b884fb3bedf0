"""Cost model: collective formulas, reshard planning, compute roofline, memory, hardware JSON, calibration."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autopar.cost_model import comm
from autopar.cost_model.calibrate import calibrate
from autopar.cost_model.comm import Step, axis_step, collective_time, reshard_steps, reshard_time, ring_time
from autopar.cost_model.compute import compute_time, flops_and_bytes, is_free
from autopar.cost_model.hardware import PRESETS, Hardware, Link, get_hardware, load_profile, save_profile
from autopar.cost_model.memory import activation_bytes, local_numel, param_state_bytes
from autopar.cost_model.precision import element_bytes, get_precision
from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.placement import B, P, Partial, S
from autopar.ir.rules.base import OpCall
from autopar.cost_model.mesh import Mesh

H100 = PRESETS["h100"]
NVL, IB = H100.intra_node, H100.inter_node
BF16 = get_precision("bf16-mixed", H100)
FP32 = get_precision("fp32", H100)


def test_collective_formulas_by_hand():
    link = Link(latency=1e-5, bandwidth=1e9)
    nb = 8e6  # bytes
    # ring steps (n - 1 or 2(n - 1) latencies) plus one latency to start the collective
    assert collective_time("all_gather", nb, 4, link) == pytest.approx(4e-5 + 0.75 * 8e-3)
    assert collective_time("reduce_scatter", nb, 4, link) == pytest.approx(4e-5 + 0.75 * 8e-3)
    assert collective_time("all_reduce", nb, 4, link) == pytest.approx(7e-5 + 1.5 * 8e-3)
    assert collective_time("all_to_all", nb, 4, link) == pytest.approx(4e-5 + 3 / 16 * 8e-3)
    assert collective_time("all_reduce", nb, 2, link) == pytest.approx(3e-5 + 8e-3)
    for kind in ("slice", "pad", "zero"):
        assert collective_time(kind, nb, 4, link) == 0.0
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, nb, 1, link) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", nb, 4, link)


def test_axis_step_table():
    table = {
        (S(0), B): "all_gather", (P, B): "all_reduce", (P, S(1)): "reduce_scatter",
        (S(0), S(1)): "all_to_all", (B, S(0)): "slice", (B, P): "zero", (S(0), P): "pad",
        (P, Partial("max")): "all_reduce", (Partial("max"), B): "all_reduce",
    }
    for (src, dst), kind in table.items():
        assert axis_step(src, dst) == kind, (src, dst)
    for x in (B, P, S(0), Partial("max")):
        assert axis_step(x, x) is None


def _mesh_dp_ib_tp_nvl() -> Mesh:
    return Mesh({"dp": 2, "tp": 4}, device="h100", links={"dp": IB})


def test_reshard_two_axes_picks_cheaper_order():
    mesh = _mesh_dp_ib_tp_nvl()
    shape, eb = (1024, 1024), 4
    n_all = 1024 * 1024 * 4
    steps = reshard_steps(shape, (S(0), S(1)), (B, B), mesh, eb)
    # dp first: gathers the tp-split quarter over IB, then the whole tensor over NVLink
    dp_first = collective_time("all_gather", n_all / 4, 2, IB) + collective_time("all_gather", n_all, 4, NVL)
    tp_first = collective_time("all_gather", n_all / 2, 4, NVL) + collective_time("all_gather", n_all, 2, IB)
    assert dp_first < tp_first
    assert [(s.kind, s.axis, s.bytes) for s in steps] == [("all_gather", 0, n_all // 4), ("all_gather", 1, n_all)]
    assert sum(s.time for s in steps) == pytest.approx(dp_first)
    assert reshard_time(shape, (S(0), S(1)), (B, B), mesh, eb) == pytest.approx(min(dp_first, tp_first))
    # all NVLink (default links for 8 devices): tp-first is no longer worse by the IB penalty
    flat = Mesh({"dp": 2, "tp": 4}, device="h100")
    a = collective_time("all_gather", n_all / 4, 2, NVL) + collective_time("all_gather", n_all, 4, NVL)
    b = collective_time("all_gather", n_all / 2, 4, NVL) + collective_time("all_gather", n_all, 2, NVL)
    assert reshard_time(shape, (S(0), S(1)), (B, B), flat, eb) == pytest.approx(min(a, b))


def test_reshard_partial_on_both_axes_counts_both():
    mesh = _mesh_dp_ib_tp_nvl()
    shape, eb = (256, 512), 2
    nb = 256 * 512 * 2
    steps = reshard_steps(shape, (P, P), (B, B), mesh, eb)
    assert sorted((s.kind, s.axis, s.bytes) for s in steps) == [("all_reduce", 0, nb), ("all_reduce", 1, nb)]
    want = collective_time("all_reduce", nb, 2, IB) + collective_time("all_reduce", nb, 4, NVL)
    assert reshard_time(shape, (P, P), (B, B), mesh, eb) == pytest.approx(want)


def test_reshard_single_axis_and_local_steps():
    mesh = _mesh_dp_ib_tp_nvl()
    shape = (8, 10)  # 10 over tp=4: DTensor pieces 3, 3, 3, 1 -> largest block 3
    # tp all_to_all S(0)->S(1) with dp split on dim 0: group sees 4 rows x 10 cols, run as equal
    # zero-padded pieces: 10 columns padded to 12
    (st,) = reshard_steps(shape, (S(0), S(0)), (S(0), S(1)), mesh, 4)
    assert (st.kind, st.axis, st.bytes) == ("all_to_all", 1, 4 * 12 * 4)
    assert st.time == pytest.approx(collective_time("all_to_all", 192, 4, NVL))
    # reduce_scatter carries the partial's reduce op
    (st,) = reshard_steps(shape, (B, Partial("max")), (B, S(1)), mesh, 4)
    assert st.kind == "reduce_scatter" and st.reduce == "max" and st.bytes == 8 * 12 * 4
    # local steps cost nothing
    assert reshard_time(shape, (B, B), (S(0), P), mesh, 4) == 0.0
    assert reshard_time(shape, (S(1), B), (S(1), B), mesh, 4) == 0.0
    assert reshard_steps(shape, (S(1), B), (S(1), B), mesh, 4) == []
    assert isinstance(reshard_steps(shape, (B, B), (S(0), B), mesh, 4)[0], Step)


def test_reshard_orders_respect_nested_splits():
    """Splits of one dim nest (axis 0 outermost): the inner axis must be gathered first, and a
    change with no valid direct order goes through the unsplit tensor."""
    mesh = _mesh_dp_ib_tp_nvl()
    shape = (16, 8)
    steps = reshard_steps(shape, (S(0), S(0)), (B, B), mesh, 4)
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("all_gather", 0)]
    steps = reshard_steps(shape, (S(0), S(0)), (S(1), S(0)), mesh, 4)
    assert [(s.kind, s.axis) for s in steps][:2] == [("all_gather", 1), ("all_gather", 0)]
    assert [(s.kind, s.axis) for s in steps][2:] == [("slice", 0), ("slice", 1)]


def test_reshard_is_memoized_and_deterministic():
    mesh = _mesh_dp_ib_tp_nvl()
    comm.cache_clear()
    t1 = reshard_time([64, 64], [S(0), S(1)], [B, B], mesh, 2)
    hits = comm.cache_info().hits
    t2 = reshard_time((64, 64), (S(0), S(1)), (B, B), Mesh.from_dict(mesh.to_dict()), 2)
    assert t1 == t2 and comm.cache_info().hits == hits + 1
    # ties broken by axis order: equal links and symmetric work -> axis 0 first
    tie = Mesh({"a": 2, "b": 2}, device="cpu")
    steps = reshard_steps((4, 4), (P, P), (B, B), tie, 4)
    assert [s.axis for s in steps] == [0, 1]


def test_reshard_memo_hits_return_what_a_fresh_computation_does():
    """The memo (speed is measured in benchmarks/, not here): repeated calls, with equal arguments
    in other forms, are cache hits returning the very steps of the first computation, and after
    the memo is cleared a fresh computation gives the same steps and time."""
    mesh = _mesh_dp_ib_tp_nvl()
    shape, src, dst = (4096, 4096), (S(0), S(1)), (S(1), B)
    comm.cache_clear()
    steps = reshard_steps(shape, src, dst, mesh, 2)
    t = reshard_time(shape, src, dst, mesh, 2)
    assert (comm.cache_info().misses, comm.cache_info().hits) == (1, 1)
    # the figure is the steps' own: each priced by ``collective_time`` on its axis's link
    assert [s.axis for s in steps] and t == sum(s.time for s in steps)
    for s in steps:
        assert s.time == collective_time(s.kind, s.bytes, mesh.shape[s.axis], mesh.links[s.axis])
    same_mesh = Mesh.from_dict(mesh.to_dict())
    for k in range(100):
        args = (list(shape), list(src), list(dst)) if k % 2 else (shape, src, dst)
        again = reshard_steps(*args, same_mesh if k % 3 else mesh, 2)
        assert len(again) == len(steps) and all(a is b for a, b in zip(again, steps))  # the memo's objects
        assert reshard_time(*args, mesh, 2) == t
    assert (comm.cache_info().misses, comm.cache_info().hits) == (1, 201)
    # another element size is another entry (twice the bytes), not a hit
    wide = reshard_steps(shape, src, dst, mesh, 4)
    assert comm.cache_info().misses == 2 and [s.bytes for s in wide] == [2 * s.bytes for s in steps]
    comm.cache_clear()
    fresh = reshard_steps(shape, src, dst, mesh, 2)
    assert comm.cache_info().misses == 1 and fresh == steps and fresh[0] is not steps[0]
    assert reshard_time(shape, src, dst, mesh, 2) == t


def _call(op, in_shapes, out_shapes, args=None, dtype=torch.float32, in_dtypes=None):
    in_dtypes = in_dtypes or [dtype] * len(in_shapes)
    refs = tuple(Ref(f"x{i}") for i in range(len(in_shapes)))
    return OpCall(
        op=op, target=None, args=args if args is not None else refs, kwargs={},
        in_specs=[TensorSpec(tuple(s), d) for s, d in zip(in_shapes, in_dtypes)],
        out_specs=[None if s is None else TensorSpec(tuple(s), dtype) for s in out_shapes],
    )


def _fb(call, precision=FP32):
    return flops_and_bytes(call, [s.shape for s in call.in_specs], [None if s is None else s.shape for s in call.out_specs], precision)


def test_matmul_flops_and_bytes():
    c = _call("aten.mm.default", [(64, 32), (32, 16)], [(64, 16)])
    f, b = _fb(c)
    assert f == 2 * 64 * 32 * 16 and b == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert _fb(c, BF16)[1] == b / 2  # activations priced at bf16 under mixed precision
    c = _call("aten.addmm.default", [(16,), (64, 32), (32, 16)], [(64, 16)])
    assert _fb(c)[0] == 2 * 64 * 32 * 16 + 64 * 16
    c = _call("aten.bmm.default", [(3, 64, 32), (3, 32, 16)], [(3, 64, 16)])
    assert _fb(c)[0] == 3 * 2 * 64 * 32 * 16
    # local shapes drive the count: a k-split mm on 4 devices does a quarter of the work
    f_local, _ = flops_and_bytes(c, [(3, 64, 8), (3, 8, 16)], [(3, 64, 16)], FP32)
    assert f_local == 3 * 2 * 64 * 8 * 16


def test_attention_flops_causal_halving_and_backward():
    b, h, s, d = 2, 4, 128, 64
    q = (b, h, s, d)
    refs = (Ref("q"), Ref("k"), Ref("v"))
    fwd = "autopar.attention.default"
    full = _call(fwd, [q, q, q], [q, (b, h, s)], args=refs + (0.0, False))
    causal = _call(fwd, [q, q, q], [q, (b, h, s)], args=refs + (0.0, True))
    assert _fb(full)[0] == 4 * b * h * s * s * d
    assert _fb(causal)[0] == 2 * b * h * s * s * d
    bwd = _call(
        fwd.replace(".default", "_backward.default"), [q, q, q, q, q, (b, h, s)], [q, q, q],
        args=(Ref("g"),) + refs + (Ref("o"), Ref("lse"), 0.0, True),
    )
    assert _fb(bwd)[0] == pytest.approx(2.5 * 2 * b * h * s * s * d)
    # without flash attention (cpu preset) the score matrix adds memory traffic (in bf16 the
    # scores' d flops per byte are under the H100's ridge, so the bytes decide)
    cpu = PRESETS["cpu"]
    assert not cpu.flash_attention
    t_flash = compute_time(full, [q] * 3, [q, (b, h, s)], H100, BF16)
    t_nonflash = compute_time(full, [q] * 3, [q, (b, h, s)], Hardware.from_dict({**H100.to_dict(), "flash_attention": False}), BF16)
    assert t_nonflash > t_flash


def test_conv_flops():
    n, ci, co, hw_, k, groups = 2, 8, 16, 10, 3, 2
    args = (Ref("x"), Ref("w"), None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups)
    c = _call("aten.convolution.default", [(n, ci, hw_, hw_), (co, ci // groups, k, k)], [(n, co, hw_, hw_)], args=args)
    fwd = 2 * n * co * hw_ * hw_ * (ci // groups) * k * k
    assert _fb(c)[0] == fwd
    bargs = (Ref("g"), Ref("x"), Ref("w"), [co], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, [True, True, False])
    cb = _call(
        "aten.convolution_backward.default", [(n, co, hw_, hw_), (n, ci, hw_, hw_), (co, ci // groups, k, k)],
        [(n, ci, hw_, hw_), (co, ci // groups, k, k), None], args=bargs,
    )
    assert _fb(cb)[0] == 2 * fwd
    cb.args = bargs[:-1] + ([False, True, False],)
    assert _fb(cb)[0] == fwd


def test_embedding_and_pointwise():
    emb = _call("aten.embedding.default", [(50000, 64), (4, 16)], [(4, 16, 64)], in_dtypes=[torch.float32, torch.int64])
    f, b = _fb(emb)
    assert f == 0 and b == 4 * 16 * 8 + 2 * 4 * 16 * 64 * 4  # ids + rows read + output; not the table
    add = _call("aten.add.Tensor", [(10, 10), (10, 10)], [(10, 10)])
    assert _fb(add) == (100, 300 * 4)
    assert element_bytes(torch.int64, "activation", BF16) == 8 and element_bytes(torch.float32, "activation", BF16) == 2


def test_free_ops_cost_zero():
    for op in ("aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
               "aten.permute.default", "aten.expand.default", "aten.squeeze.dim", "aten.squeeze.dims",
               "aten.slice.Tensor", "aten.select.int", "aten.split.Tensor", "aten.unbind.int", "aten.reshape.default",
               "autopar.hint.default", "placeholder", "get_attr", "aten.detach.default", "aten.alias.default",
               "aten.unsqueeze.default", "aten.split_with_sizes.default", "aten.lift_fresh_copy.default"):
        assert is_free(op), op
        c = _call(op, [(4, 4)], [(4, 4)])
        assert compute_time(c, [(4, 4)], [(4, 4)], H100, BF16) == 0.0
    for op in ("aten.mm.default", "aten.add.Tensor", "aten.clone.default", "aten.select_backward.default"):
        assert not is_free(op)


def test_compute_time_roofline():
    m = k = n = 8192
    e = H100.efficiency
    mm = _call("aten.mm.default", [(m, k), (k, n)], [(m, n)])
    t = compute_time(mm, [(m, k), (k, n)], [(m, n)], H100, BF16)
    e_mm = e.mm_max * (m * n / (m * n + e.mm_half_mn)) * (k / (k + e.mm_half_k))
    assert 0.7 < e_mm < e.mm_max  # a large square matmul runs close to the best rate, never above
    assert t == pytest.approx(2 * m * k * n / (989e12 * e_mm) + 5e-6)  # compute-bound, bf16 rate
    t32 = compute_time(mm, [(m, k), (k, n)], [(m, n)], H100, get_precision("model", H100))
    assert t32 == pytest.approx(2 * m * k * n / (67e12 * e_mm) + 5e-6)  # own dtype float32
    add = _call("aten.add.Tensor", [(m, n), (m, n)], [(m, n)])
    t = compute_time(add, [(m, n)] * 2, [(m, n)], H100, BF16)
    nbytes = 3 * m * n * 2
    assert t == pytest.approx(nbytes / (3.35e12 * e.mem_max * nbytes / (nbytes + e.mem_half_bytes)) + 5e-6)
    tiny = _call("aten.add.Tensor", [(1,), (1,)], [(1,)])
    # a tiny kernel: the launch floor plus the memory's latency (half_bytes at the best bandwidth)
    floor = 5e-6 + e.mem_half_bytes / (3.35e12 * e.mem_max)
    assert compute_time(tiny, [(1,)] * 2, [(1,)], H100, BF16) == pytest.approx(floor, rel=1e-4)


def test_param_state_bytes_bf16_mixed_adamw():
    mesh = Mesh({"dp": 4}, device="h100")
    assert BF16.optimizer_bytes == 8
    st = param_state_bytes((10, 6), (B,), mesh, BF16)
    assert st == {"params": 240, "grads": 240, "optimizer": 480} and sum(st.values()) == 16 * 60
    st = param_state_bytes((10, 6), (S(0),), mesh, BF16)  # 10 rows over 4: 3, 3, 3, 1 -> largest 3
    assert sum(st.values()) == 16 * 18
    st = param_state_bytes((12, 6), (S(0),), mesh, BF16)
    assert sum(st.values()) == 16 * 72 // 4
    sgd = get_precision("fp32", PRESETS["cpu"], optimizer="sgd")
    assert sum(param_state_bytes((10, 6), (B,), mesh, sgd).values()) == 8 * 60
    assert get_precision("fp32", H100, "sgd-momentum").optimizer_bytes == 4
    assert get_precision(None, PRESETS["cpu"]).name == "fp32" and get_precision(None, H100).name == "bf16-mixed"
    with pytest.raises(ValueError, match="unknown precision"):
        get_precision("int4", H100)


def test_local_numel_and_activation_bytes():
    mesh = Mesh({"dp": 2, "tp": 4}, device="h100")
    assert local_numel((5, 7), (S(0), S(0)), mesh) == 1 * 7  # 5 -> 3 on dp, 3 -> 1 on tp
    assert local_numel((8, 8), (S(0), S(1)), mesh) == 4 * 2
    assert local_numel((8, 8), (P, B), mesh) == 64
    assert activation_bytes((8, 8), torch.float32, (S(0), S(1)), mesh, BF16) == 16
    assert activation_bytes((8, 8), torch.int64, (S(0), S(1)), mesh, BF16) == 64


def test_hardware_presets_and_round_trip():
    for name, hw in PRESETS.items():
        d = json.loads(json.dumps(hw.to_dict()))
        assert Hardware.from_dict(d) == hw and Hardware.from_dict(d).to_dict() == hw.to_dict()
        assert set(hw.peak_flops) >= {"bfloat16", "float16", "float32", "float64"}
        assert get_hardware(name) is hw
    # links at NCCL's achieved bus bandwidth (maintainers' figures, cited in the presets), not line rate
    assert H100.peak_flops["bfloat16"] == 989e12 and H100.intra_node.bandwidth == 360e9
    assert H100.inter_node.bandwidth == 48e9 and H100.memory == 80_000_000_000
    assert PRESETS["h200"].intra_node == H100.intra_node and PRESETS["h200"].inter_node == H100.inter_node
    assert PRESETS["h200"].memory == 141_000_000_000 and PRESETS["h200"].hbm_bandwidth == 4.8e12
    assert PRESETS["a100"].intra_node.bandwidth == 230e9 and PRESETS["a100"].inter_node.bandwidth == 24e9
    with pytest.raises(ValueError, match="unknown device 'v100'.*a100"):
        get_hardware("v100")
    with pytest.raises(ValueError, match="unknown fields"):
        Hardware.from_dict({**H100.to_dict(), "bogus": 1})


def test_profile_save_load(tmp_path):
    hw = Hardware.from_dict({**PRESETS["cpu"].to_dict(), "name": "box", "hbm_bandwidth": 12.5e9})
    save_profile(hw, tmp_path / "hw.json")
    assert load_profile(tmp_path / "hw.json") == hw
    assert get_hardware("cpu", tmp_path / "hw.json") == hw
    (tmp_path / "part.json").write_text(json.dumps({"base": "a100", "memory": 40_000_000_000}))
    part = load_profile(tmp_path / "part.json")
    assert part.memory == 40_000_000_000 and part.peak_flops == PRESETS["a100"].peak_flops
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


@pytest.mark.slow
def test_calibrate_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "cpu.json"
    lines: list = []
    hw = calibrate(path, nprocs=2, quick=True, report=lines)
    loaded = load_profile(path)
    assert loaded == hw
    assert all(v > 0 and math.isfinite(v) for v in hw.peak_flops.values())
    assert hw.hbm_bandwidth > 0 and hw.launch_floor > 0
    assert hw.intra_node.latency > 0 and hw.intra_node.bandwidth > 0
    mesh = Mesh({"dp": 2}, device="cpu", profile=path)
    assert mesh.hardware == hw and mesh.links == (hw.intra_node,)
    # measured in 2 processes: every collective kind between compute, listed against its price
    assert hw.name == "cpu-calibrated-2procs" and 0.0 <= hw.overlap_slowdown < 1.0
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert any(line.startswith(f"{kind} 1024 B: measured ") for line in lines), lines
    # each kind other than the all-reduce has its measured factor over its ring time, recorded in
    # the profile and used by the price of a mesh made with it
    factors = dict(hw.intra_node.factors)
    assert sorted(factors) == ["all_gather", "all_to_all", "reduce_scatter"]
    assert all(f > 0 and math.isfinite(f) for f in factors.values())
    assert json.loads(path.read_text())["intra_node"]["factors"] == factors
    link = mesh.links[0]
    for kind, f in factors.items():
        assert collective_time(kind, 1 << 20, 2, link) == pytest.approx(f * ring_time(kind, 1 << 20, 2, link))
        assert any(line.startswith(f"{kind} 1024 B:") and f"; {f:.2f}x its ring time" in line for line in lines)
