"""Fold: repeated layers are found (from the graph, whatever the module structure), their instances
are alike, and the problem's size does not grow with depth."""

import json
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from _parity import build, plan_json, simulated_errors
from torch import nn

import autopar
import autopar.models as M
from autopar.cost_model.casting import cast_policy
from autopar.cost_model.gathers import gather_shares
from autopar.cost_model.precision import get_precision
from autopar.ir.capture import capture
from autopar.ir.graph import Phase
from autopar.ir.layers import layer_members, layer_of, layers
from autopar.passes.search.build import build_problem
from autopar.passes.search.fold import fold
from autopar.passes.search.merge import merge
from autopar.passes.search.problem import evaluate, transfer_cost
from autopar.passes.search.strategies import node_strategies

warnings.simplefilter("ignore")


@pytest.mark.parametrize("family, depth_kw", [("llama", "n_layers"), ("moe", "n_layers"), ("gpt", "n_layer")])
def test_problem_size_does_not_grow_with_depth(family, depth_kw):
    sizes = []
    for depth in (3, 6):
        model, inputs = M.make(family, device="meta", **{depth_kw: depth})
        graph = capture(model, inputs)
        folding = fold(graph)
        assert len(folding.groups) == 1
        group = folding.groups[0]
        assert group.count >= depth - 1  # the first or last layer may differ (embedding, head)
        representatives = {folding.representative(n.name) for n in graph.nodes}
        sizes.append(len(representatives))
    # LLaMA and MoE fold their gradient accumulation too; GPT's tied embedding leaves 2 per layer
    assert sizes[1] - sizes[0] <= (6 if family == "gpt" else 0)


def test_instances_are_alike_node_by_node():
    model, inputs = M.make("llama", device="meta", n_layers=4)
    graph = capture(model, inputs)
    folding = fold(graph)
    group = folding.groups[0]
    for names in group.instances[1:]:
        for a, b in zip(group.instances[0], names):
            na, nb = graph.node(a), graph.node(b)
            assert (na.op, na.outputs, na.phase) == (nb.op, nb.outputs, nb.phase)
            assert folding.representative(b) == a
            assert folding.multiplicity(b) == group.count


def test_distinct_layers_do_not_fold():
    model, inputs = M.make("cnn", device="meta")  # every stage has its own widths
    assert fold(capture(model, inputs)).groups == []


# ---------------------------------------------------------------------------------------------
# structural folding: layers found from the graph, whatever the module structure

try:
    import transformers
except ImportError:  # pragma: no cover - transformers is a test dependency
    transformers = None

needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


class _Encoder(nn.Module):
    """``nn.TransformerEncoder`` with an embedding and a head, returning a mean loss."""

    def __init__(self, layers: int):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), layers, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, ids, targets):
        y = self.head(self.encoder(self.emb(ids)))
        return F.cross_entropy(y.reshape(-1, 100), targets.reshape(-1))


def _model(name: str, depth: int):
    """``(model, args, kwargs)`` of one of the models whose folding is tested, at ``depth`` layers."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    if name in ("llama", "llama_loop", "gpt"):
        model, args = M.make(name, device="meta", **{"n_layer" if name == "gpt" else "n_layers": depth})
        return model, args, None
    if name == "encoder":
        return _Encoder(depth), (ids, ids), None
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    if name == "hf_gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=depth, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                           attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                           eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                             attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model.config._attn_implementation = "sdpa"
    return model, (), dict(input_ids=ids, labels=ids)


def _merged(graph):
    """The folding and the merged ILP of ``graph`` on a (2, 2) CPU mesh (the planning passes up to
    the solve)."""
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")
    folding = fold(graph)
    strategies = {n.name: node_strategies(graph, n, mesh) for n in graph.nodes
                  if folding.representative(n.name) == n.name}
    problem = build_problem(graph, mesh, folding, strategies, get_precision(None, mesh.hardware), 1e15)
    return folding, merge(problem, {n.name: n.op for n in graph.nodes})


MODELS = ["llama_loop", "llama", "gpt", "encoder",
          pytest.param("hf_llama", marks=needs_hf), pytest.param("hf_gpt2", marks=needs_hf)]


@pytest.mark.parametrize("name", MODELS)
def test_merged_problem_has_as_many_nodes_at_2_and_8_layers(name):
    """Every instance folds (its own ops, the parent's ops between the layers, their backward), so
    the problem the solver sees is the same size at any depth."""
    sizes = []
    for depth in (2, 8):
        model, args, kwargs = _model(name, depth)
        graph = capture(model, args, kwargs)
        folding, merged = _merged(graph)
        assert len(folding.groups) == 1 and folding.groups[0].count == depth, [
            (g.prefix, g.indices) for g in folding.groups]
        sizes.append(len(merged.problem.nodes))
    assert sizes[0] == sizes[1], sizes


def _functional_ops(graph):
    """The ops the functional-loop decoder runs in its own ``forward`` between the layers' linears
    (attention, RoPE's products, SwiGLU's product, residual adds), forward and backward."""
    return [n for n in graph.ops() if n.module_path == "" and (
        n.op.startswith("autopar.attention") or n.op in ("aten.silu.default", "aten.silu_backward.default", "aten.cat.default"))]


def test_the_parents_ops_belong_to_the_layer_they_run_for():
    model, args = M.make("llama_loop", n_layers=4)
    graph = capture(model, args)
    found = layers(graph)
    ops = _functional_ops(graph)
    assert {graph.node(n.name).phase for n in ops} == {Phase.FORWARD, Phase.BACKWARD}
    for n in ops:
        assert found.of(n.name) is not None, n.where()
    # attention i (forward and backward) belongs to instance i: the i-th forward one, and the
    # backward ones in reverse
    attn = [n.name for n in graph.ops() if n.op.startswith("autopar.attention")]
    fwd = [n for n in attn if graph.node(n).phase == Phase.FORWARD]
    bwd = [n for n in attn if graph.node(n).phase == Phase.BACKWARD]
    assert [found.of(n) for n in fwd] == [("layers", i) for i in range(4)]
    assert [found.of(n) for n in bwd] == [("layers", i) for i in reversed(range(4))]
    # the parameters anchor their instance; the embedding, the final norm and the head stay outside
    for fqn, node in graph.params.items():
        assert found.of(node) == (layer_of(fqn) if fqn.startswith("layers.") else None), fqn
    assert found.alike == {"layers": (0, 1, 2, 3)}
    assert layer_members(graph) == found.members()


def test_cast_policy_treats_every_instance_alike():
    """The cast policy's layer region is the folding's: under bf16-mixed the ops at one position of
    every instance compute in one dtype, parent-forward ops included."""
    model, args = M.make("llama_loop", n_layers=3)
    graph = capture(model, args)
    policy = cast_policy(graph, "bf16-mixed")
    group = fold(graph).groups[0]
    assert group.count == 3
    for names in group.instances[1:]:
        assert [policy.modes.get(n) for n in names] == [policy.modes.get(n) for n in group.instances[0]]
    assert all(policy.modes[n.name] == torch.bfloat16 for n in _functional_ops(graph) if n.phase == Phase.FORWARD)


def test_gather_shares_follow_the_instances():
    """Parameter gathers are grouped per instance of the membership: each instance's shares sum
    to one latency; a parameter outside the layers pays the whole latency."""
    model, args = M.make("llama_loop", n_layers=3)
    graph = capture(model, args)
    found = layers(graph)
    shares = gather_shares(graph)
    per_instance: dict = {}
    for fqn, node in graph.params.items():
        if found.of(node) is None:
            assert shares[node] == 1.0, fqn
            continue
        per_instance[found.of(node)] = per_instance.get(found.of(node), 0.0) + shares[node]
    assert set(per_instance) == {("layers", i) for i in range(3)}
    assert all(abs(v - 1.0) < 1e-9 for v in per_instance.values()), per_instance


@pytest.mark.slow
def test_functional_loop_decoder_plans_run_as_the_model():
    """The searched plan of the functional-loop decoder on (2, 2) runs in the simulator and gives
    the single device's loss and gradients, planning it twice gives the same bytes, and its
    per-module figures are by the user's module paths."""
    text = plan_json("llama_loop", (("dp", 2), ("tp", 2)))
    assert plan_json.__wrapped__("llama_loop", (("dp", 2), ("tp", 2))) == text
    plan = autopar.Plan.from_dict(json.loads(text))
    # per-module figures stay by the user's module paths (the parent's own ops under the root)
    paths = {m["path"] for m in plan.modules}
    assert {"", "layers.0.wq", "layers.1.w2", "layers.1.ffn_norm"} <= paths, sorted(paths)
    model, args = build("llama_loop")
    loss_err, grad_errs = simulated_errors(model, plan, args)
    assert loss_err < 1e-6
    for name, err in grad_errs.items():
        assert err < 1e-6, name


def test_the_cut_is_where_fewest_values_cross():
    """``fewest_crossing_cut``'s one sweep finds what counting the crossing values at every cut finds."""
    from autopar.ir.layers import fewest_crossing_cut

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(3, 30)
        last_read = [rng.choice([p, rng.randrange(p, n + 5)]) for p in range(n)]
        start, nxt = rng.randrange(0, n // 2), rng.randrange(n // 2 + 1, n + 1)
        last = rng.randrange(start, nxt)
        crossing = [sum(1 for p in range(start, c) if last_read[p] >= c) for c in range(last + 1, nxt + 1)]
        best = min(crossing)
        assert fewest_crossing_cut(start, last, nxt, last_read) == max(k for k, x in enumerate(crossing) if x == best)


def test_without_sequence_numbers_module_paths_stand_in():
    """A graph whose nodes carry no autograd sequence numbers (the backward cannot follow its
    forward op) still folds, by module paths."""
    model, args = M.make("llama", device="meta", n_layers=3)
    graph = capture(model, args)
    for n in graph.nodes:
        if n.fx_node is not None:
            n.fx_node.meta.pop("seq_nr", None)
    group = fold(graph).groups[0]
    assert (group.prefix, group.indices) == ("layers", [0, 1, 2])
    assert all(graph.node(n).module_path.startswith(f"layers.{i}") or not graph.node(n).module_path
               for i, names in zip(group.indices, group.instances) for n in names)


# the corpus (tests/_corpus.py): every model that repeats a block, at tiny size

@needs_hf
@pytest.mark.parametrize("name", ["titan_llama", "torch_encoder", "hf_gpt2", "hf_llama", "hf_bert", "hf_t5",
                                  "hf_vit", "hf_mixtral", "hf_bart"])
def test_corpus_models_fold_every_block(name):
    """Each corpus model's blocks all fold, at 2 layers and at 8, and the merged problem is as
    large at 8 layers as at 2: T5's relative position bias, computed in the first block only and
    read by all, stays outside the instances, and the last block, which lacks its own gradient
    accumulation of that bias (and of the encoder output the decoder blocks read; BART's too), folds
    with the others; Mixtral's router backward (an in-place division rewritten at capture, whose backward has
    no forward op of its sequence number) stays in its layer."""
    import _corpus

    sizes = []
    for depth in (2, 8):
        model, args, kwargs = _corpus.build(name, layers=depth)
        folding, merged = _merged(capture(model, args, kwargs))
        assert folding.groups and all(g.count == depth for g in folding.groups), [
            (g.prefix, g.indices) for g in folding.groups]
        sizes.append(len(merged.problem.nodes))
    assert sizes[0] == sizes[1], sizes


def test_a_value_made_once_and_read_by_every_instance_stays_outside():
    """T5's first block computes the position bias (and its mask) that every block reads: those ops
    belong to no instance, so block 0 agrees with block 1 and both fold."""
    import _corpus

    model, args, kwargs = _corpus.build("hf_t5", layers=2)
    graph = capture(model, args, kwargs)
    found = layers(graph)
    bias = [n for n in graph.nodes if n.module_path.endswith("relative_attention_bias") and not n.is_placeholder
            and n.phase == Phase.FORWARD]
    assert bias and all(found.of(n.name) is None for n in bias)
    assert found.alike == {"decoder.block": (0, 1), "encoder.block": (0, 1)}


class _SharedGate(nn.Module):
    """A gate made once, outside the blocks, and read by every block (as T5's position bias): its
    gradient sums L uses in L - 1 accumulations, so one block lacks its own."""

    def __init__(self, layers: int, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        h = self.inp(x)
        g = torch.sigmoid(self.gate(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * g
        return h.pow(2).mean()


@pytest.mark.parametrize("depth", [2, 4])
def test_an_instance_lacking_an_accumulation_folds_and_prices_as_unfolded(depth):
    """Every block folds, the one without its own accumulation of the gate's gradient included
    (at the positions of the nodes it has), and the folded problem prices every choice as the
    unfolded one does: compute, memory and communication, each node counted as often as its
    position occurs (the lacking position one instance fewer)."""
    from autopar.passes.search.fold import no_folding

    torch.manual_seed(0)
    graph = capture(_SharedGate(depth), (torch.randn(8, 16),))
    found = layers(graph)
    assert found.alike == {"blocks": tuple(range(depth))}
    assert len(found.positions) == 1  # one block lacks an accumulation, and folds all the same
    (key, at), = found.positions.items()
    assert len(at) == len(found.instances[key]) < len(found.instances[("blocks", 0)])
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="cpu")
    prec = get_precision(None, mesh.hardware)
    strategies = {n.name: node_strategies(graph, n, mesh) for n in graph.nodes}
    folding = fold(graph)
    assert [g.count for g in folding.groups] == [depth] and sum(folding.groups[0].lacking.values()) >= 1
    folded = build_problem(graph, mesh, folding, strategies, prec, 1e15)
    flat = build_problem(graph, mesh, no_folding(), strategies, prec, 1e15)

    def totals(problem, choice):
        comm = sum(n.mult * n.comm[s] for n, s in zip(problem.nodes, choice))
        for ks in problem.transfers:
            edges = [problem.edges[k] for k in ks]
            comm += edges[0].mult * transfer_cost(edges, choice)
        cost = evaluate(problem, choice)
        return cost.compute_time, comm, cost.memory

    rng = random.Random(0)
    for _ in range(5):
        choice = [rng.randrange(len(n.strategies)) for n in folded.nodes]
        expanded = [choice[folded.index[folding.representative(n.name)]] for n in flat.nodes]
        (c1, m1, mem1), (c2, m2, mem2) = totals(folded, choice), totals(flat, expanded)
        assert c1 == pytest.approx(c2, rel=1e-12) and m1 == pytest.approx(m2, rel=1e-9)
        assert mem1 == pytest.approx(mem2, rel=1e-12)
