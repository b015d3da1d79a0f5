"""Each dimension file copied alone into another project, beside a Llama-style model written here.

The model below is not model.py: it is written the way Llama-style models are
(separate q, k, v projections, grouped-query attention, rotary positions,
RMSNorm, SwiGLU MLPs with separate gate, up and down, no biases, an MoE layer
whose router is called `gate` and which has a shared expert; optionally Qwen3's attention, heads wider
than the width over the heads and QK-norm), keeping only
what each file's docstring asks of a model. Each test copies one file into an
empty folder, imports it from there (so it can lean on nothing else in this
repository), glues it on with the few lines its docstring promises (the
`glue_*` functions: what a user would write), and checks it against the same
model on one process in float64.
"""
import copy
import importlib.util
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distributed import REPO, run_on_ranks

VOCAB, D, HEADS, KV_HEADS, FF, LAYERS, SEQ, BATCH = 32, 16, 4, 2, 24, 2, 8, 4


# -- a small Llama-style model -----------------------------------------------------------------

def rope(x, pos):
    """Rotary embedding of (batch, heads, seq, head_dim), pairs (i, i + half) turned by pos * 10000^(-i/half)."""
    half = x.shape[-1] // 2
    angles = pos.to(x.dtype)[:, None] * 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], -1)


def attention(q, k, v):
    """Causal attention; each key/value head serves a group of consecutive query heads."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


QWEN3 = dict(head_dim=6, qk_norm=True)  # Qwen3's attention: 4 heads of 6 over D = 16, QK-norm


class Attention(nn.Module):
    def __init__(self, head_dim=D // HEADS, qk_norm=False):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(D, HEADS * head_dim, bias=False)
        self.k_proj = nn.Linear(D, KV_HEADS * head_dim, bias=False)
        self.v_proj = nn.Linear(D, KV_HEADS * head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * head_dim, D, bias=False)
        # QK-norm (Qwen3): one RMSNorm of head_dim for every head's query, one for every head's key
        self.q_norm, self.k_norm = (nn.RMSNorm(head_dim) if qk_norm else nn.Identity() for _ in range(2))
        self.core = attention

    def forward(self, x, pos):
        batch, seq = x.shape[0], x.shape[1]
        # Heads are read off the shapes (-1), as Llama's code does: a rank holding some of them runs this too.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        y = self.core(rope(q, pos), rope(k, pos), v)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, width=FF):
        super().__init__()
        self.gate_proj = nn.Linear(D, width, bias=False)
        self.up_proj = nn.Linear(D, width, bias=False)
        self.down_proj = nn.Linear(width, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Qwen2-MoE's block: top-k of a softmax router with a bias, the gates as the softmax gave them
    (norm_topk_prob False), plus for every token a shared expert of its own width behind a sigmoid gate."""

    def __init__(self, n_experts=4, top_k=2):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, False
        self.gate = nn.Linear(D, n_experts)
        self.experts = nn.ModuleList(SwiGLU(8) for _ in range(n_experts))
        self.shared_expert = SwiGLU(12)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def forward(self, x):
        tokens = x.reshape(-1, D)
        probs = self.gate(tokens).softmax(-1)
        gates, chosen = probs.topk(self.top_k, -1)
        out = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, choice = torch.where(chosen == e)
            if len(token_idx):
                out = out.index_add(0, token_idx, expert(tokens[token_idx]) * gates[token_idx, choice, None])
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self, moe, **attention):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attn = Attention(**attention)
        self.mlp = MoE() if moe else SwiGLU()

    def forward(self, x, pos):
        x = x + self.self_attn(self.input_layernorm(x), pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, moe=False, n_layers=LAYERS, **attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Layer(moe, **attention) for _ in range(n_layers))
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids, pos):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, pos)
        return self.lm_head(self.norm(x))


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- helpers ---------------------------------------------------------------------------------

def copy_alone(filename, folder):
    """Copy one dimension file into an empty folder; the folder, for the ranks to import it from."""
    assert not os.listdir(folder)
    shutil.copy(os.path.join(REPO, filename), folder)
    return str(folder)


def import_copy(folder, filename):
    """The copied file, imported from its folder under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"copied_{filename[:-3]}", os.path.join(folder, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(moe=False, n_layers=LAYERS, **attention):
    """The model, a batch and the single process's loss and gradients (float64)."""
    torch.manual_seed(0)
    model = Llama(moe, n_layers, **attention).double()
    with torch.no_grad():  # QK-norm's weights of their own, so that each head's share of their gradient differs
        for norm in [m for name, m in model.named_modules() if name.endswith(("q_norm", "k_norm")) and
                     isinstance(m, nn.RMSNorm)]:
            norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(model(ids[:, :-1], torch.arange(SEQ)), ids[:, 1:])
    loss.backward()
    return model, ids, loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def fresh_copy(model):
    copied = copy.deepcopy(model)
    copied.zero_grad(set_to_none=True)
    return copied


def worst(a, b):
    return (a - b).abs().max().item()


# -- tp.py -----------------------------------------------------------------------------------

SWIGLU = dict(columns=("gate_proj", "up_proj"), row="down_proj")  # the Llama's MLP layers, for tp.py's splits


def glue_tp(tp, model, group, sp):
    """tp.py on the Llama: vocabulary-parallel embedding and head; in each layer q/k/v (by whole heads) and
    gate/up column-parallel behind one shared entry each, o and down row-parallel (in an MoE, the shared
    expert's, and the router's gradient summed over the group; QK-norm's q_norm and k_norm summed by
    split_attention, sp or not); under sequence parallelism the norms' gradients summed (each once: the loop
    meets q_norm and k_norm again)."""
    plan = tp.SequenceParallel(group) if sp else tp.TensorParallel(group)
    model.embed_tokens = tp.VocabParallelEmbedding(model.embed_tokens, plan)
    for layer in model.layers:
        attention = layer.self_attn
        tp.split_attention(attention, plan, attention.head_dim, ("q_proj", "k_proj", "v_proj"), "o_proj")
        if hasattr(layer.mlp, "experts"):  # the MoE (ep.py's layer made from it, or the MoE itself)
            tp.split_moe(layer.mlp, plan, router="gate", shared="shared_expert", shared_gate="shared_expert_gate",
                         **SWIGLU)
        else:
            tp.split_mlp(layer.mlp, plan, **SWIGLU)
    for norm in [m for m in model.modules() if isinstance(m, nn.RMSNorm)]:
        plan.norm(norm)
    model.lm_head = tp.ColumnParallelLinear(model.lm_head, plan)
    return lambda logits, targets: tp.vocab_parallel_cross_entropy(logits, targets, model.embed_tokens.vocab_start,
                                                                   group)


def tp_worker(folder, sequence_parallel, attention):
    tp = import_copy(folder, "tp.py")
    ref, ids, ref_loss, ref_grads = reference(**attention)
    model = fresh_copy(ref)
    loss_fn = glue_tp(tp, model, None, sequence_parallel)
    loss = loss_fn(model(ids[:, :-1], torch.arange(SEQ)), ids[:, 1:])
    tp.comm_bytes.clear()
    loss.backward()
    layouts = tp.sharded_layouts(model)
    grads = {name: tp.unshard(p.grad, layouts[name][0], None, layouts[name][1]) if name in layouts else p.grad
             for name, p in model.named_parameters()}
    return dict(loss=abs(loss.item() - ref_loss), grads=max(worst(grads[k], ref_grads[k]) for k in ref_grads),
                names=sorted(grads) == sorted(ref_grads), backward_bytes=dict(tp.comm_bytes))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["sp-off", "sp"])
@pytest.mark.parametrize("attention", [{}, QWEN3], ids=["tp2", "tp2-qwen3"])
def test_tp_on_a_llama_with_separate_projections(tmp_path, sequence_parallel, attention):
    folder = copy_alone("tp.py", tmp_path)
    n, activation = 2, BATCH * SEQ * D * 8  # bytes of one (batch, seq, width) float64 tensor
    for r in run_on_ranks(n, tp_worker, folder, sequence_parallel, attention):
        assert r["loss"] < 1e-12 and r["grads"] < 1e-12 and r["names"]
        # Backward: q, k, v share one entry and gate, up another, so each layer costs two collectives of
        # b*s*d there (not five), and the LM head's entry one more. With sp those are reduce-scatters,
        # the row-parallel layers' and the embedding's all-gathers, and the 2L+1 RMSNorm weights of width
        # D are summed over the group. QK-norm's two weights of head_dim a layer are summed, sp or not.
        ring = (n - 1) / n
        head_norms = 2 * LAYERS * 2 * ring * attention.get("head_dim", 0) * 8
        if sequence_parallel:
            assert r["backward_bytes"] == {"reduce_scatter": (2 * LAYERS + 1) * ring * activation,
                                           "all_gather": (2 * LAYERS + 1) * ring * activation,
                                           "all_reduce": (2 * LAYERS + 1) * 2 * ring * D * 8 + head_norms}
        else:
            assert r["backward_bytes"] == {"all_reduce": (2 * LAYERS + 1) * 2 * ring * activation + head_norms}


# -- cp.py -----------------------------------------------------------------------------------

def glue_cp(cp, model, group):
    """cp.py on the Llama: ring attention as the attention core (the caller shards tokens and positions)."""
    for layer in model.layers:
        layer.self_attn.core = lambda q, k, v: cp.ring_attention(q, k, v, group)[0]


def cp_worker(folder):
    cp = import_copy(folder, "cp.py")
    rank, n = dist.get_rank(), dist.get_world_size()
    ref, ids, ref_loss, ref_grads = reference()
    model = fresh_copy(ref)
    glue_cp(cp, model, None)
    inputs, targets = (cp.shard_sequence(t, n, rank) for t in (ids[:, :-1], ids[:, 1:]))
    loss = cross_entropy(model(inputs, cp.zigzag_positions(SEQ, n, rank)), targets)
    loss.backward()
    cp.comm_bytes.clear()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # every rank holds as many tokens: the mean over ranks is the full mean
    errors = [abs(mean_loss.item() / n - ref_loss)]
    for name, p in model.named_parameters():  # summed and averaged over the ranks, as data parallelism would
        dist.all_reduce(p.grad)
        errors.append(worst(p.grad / n, ref_grads[name]))
    return max(errors)


def test_cp_on_a_llama_with_grouped_query_attention(tmp_path):
    folder = copy_alone("cp.py", tmp_path)
    assert max(run_on_ranks(2, cp_worker, folder)) < 1e-12


# -- pp.py -----------------------------------------------------------------------------------

def glue_pp(pp, model, rank, placement):
    """pp.py on the Llama: this rank's model chunks as callables (ids or activations in, activations or
    logits out), the layers of split_layers, listed in the order of placement.model_chunks(rank)."""
    ranges, last = pp.split_layers(len(model.layers), placement.n_model_chunks), placement.n_model_chunks - 1
    pos = torch.arange(SEQ)

    def chunk(k):
        def run(x):
            x = model.embed_tokens(x) if k == 0 else x
            for i in ranges[k]:
                x = model.layers[i](x, pos)
            return model.lm_head(model.norm(x)) if k == last else x
        return run
    return [chunk(k) for k in placement.model_chunks(rank)]


def pp_worker(folder, schedule):
    pp = import_copy(folder, "pp.py")
    rank, n, micro = dist.get_rank(), dist.get_world_size(), 4
    schedules = [pp.make_schedule(schedule, micro, n, r) for r in range(n)]
    placement = schedules[rank].placement  # ZB-V's a V: rank r holds model chunks r and 2P-1-r
    ref, ids, ref_loss, ref_grads = reference(n_layers=LAYERS * placement.n_chunks)  # a layer a chunk
    model = fresh_copy(ref)
    micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in ids.chunk(micro)]
    losses, _ = pp.run_schedule(schedules, glue_pp(pp, model, rank, placement), micro_batches, cross_entropy,
                                None, (BATCH // micro, SEQ, D), torch.float64, torch.device("cpu"))
    errors = [abs(sum(losses) / micro - ref_loss)] if rank == placement.last_rank else []
    errors += [worst(p.grad, ref_grads[name]) for name, p in model.named_parameters() if p.grad is not None]
    used = sorted(name for name, p in model.named_parameters() if p.grad is not None)
    return max(errors), used, sorted(ref_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv"])
def test_pp_on_a_llama_cut_into_stages(tmp_path, schedule):
    folder = copy_alone("pp.py", tmp_path)
    results = run_on_ranks(2, pp_worker, folder, schedule)
    assert max(error for error, _, _ in results) < 1e-12
    everything = results[0][2]
    assert sorted(results[0][1] + results[1][1]) == everything  # the stages together hold every parameter


def pp_misplaced_worker(folder):
    """ZB-V run on a placement it was not written for: listed by hand with none, or made with a loop."""
    pp = import_copy(folder, "pp.py")
    rank, n, micro = dist.get_rank(), dist.get_world_size(), 4
    model = Llama(n_layers=2 * LAYERS).double()
    micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in torch.randint(0, VOCAB, (BATCH, SEQ + 1)).chunk(micro)]
    run = lambda schedules, **placement: pp.run_schedule(  # noqa: E731
        schedules, glue_pp(pp, model, rank, pp.Placement.of("zbv", n, 2)), micro_batches, cross_entropy, None,
        (BATCH // micro, SEQ, D), torch.float64, torch.device("cpu"), **placement)
    errors = []
    for schedules, placement in [([pp.zero_bubble_v(micro, n, r) for r in range(n)], {}),
                                 ([pp.make_schedule("zbv", micro, n, r) for r in range(n)],
                                  {"placement": pp.Placement(n, 2)})]:
        with pytest.raises(ValueError) as refused:
            run(schedules, **placement)
        errors.append(str(refused.value))
    return errors


def test_pp_refuses_a_v_schedule_on_the_wrong_placement_and_names_the_right_one(tmp_path):
    hand_listed, made = run_on_ranks(2, pp_misplaced_worker, copy_alone("pp.py", tmp_path))[0]
    assert "placement=Placement.of('zbv', 2, 2)" in hand_listed and "deadlocks" not in hand_listed
    assert "model_chunks(r): [[0, 3], [1, 2]]" in hand_listed
    assert "written for placement=Placement.of('zbv', 2, 2), not Placement(2, 2)" in made


# -- ep.py -----------------------------------------------------------------------------------

def ep_worker(folder):
    ep = import_copy(folder, "ep.py")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    moe = MoE().double()
    g = torch.Generator().manual_seed(1)
    tokens, grad = (torch.randn(n, 6, D, generator=g, dtype=torch.float64) for _ in range(2))
    (moe(tokens.flatten(0, 1)) * grad.flatten(0, 1)).sum().backward()
    layer = ep.ExpertParallelMoE(fresh_copy(moe), None, None, router="gate", shared="shared_expert",  # the glue
                                 shared_gate="shared_expert_gate")
    out = layer(tokens[rank])
    (out * grad[rank]).sum().backward()
    errors = [worst(out, moe(tokens[rank]))]
    reference = dict(moe.named_parameters())
    for name, p in layer.named_parameters():
        if not name.startswith("experts."):  # replicated (router, shared expert): each rank saw its tokens only
            dist.all_reduce(p.grad)
        errors.append(worst(p.grad, reference[name].grad))
    return max(errors), sorted(name for name, _ in layer.named_parameters())


def test_ep_on_an_moe_with_its_own_router_name_and_a_shared_expert(tmp_path):
    folder = copy_alone("ep.py", tmp_path)
    results = run_on_ranks(2, ep_worker, folder)
    assert max(error for error, _ in results) < 1e-12
    names = set(results[0][1]) | set(results[1][1])
    assert names == {name for name, _ in MoE().named_parameters()}  # the single device's names, nothing renamed
    assert [{name.split(".")[1] for name in names if name.startswith("experts.")} for _, names in results] == \
        [{"0", "1"}, {"2", "3"}]  # each rank holds half of the experts


# -- ep.py folded over tp.py --------------------------------------------------------------------

def glue_ep_over_tp(tp, ep, model, sp, expert_tp):
    """ep.py's layer in place of each MoE, its experts spread over the tp ranks (or, with expert_tp, held by
    every rank in slices: tp.py's split_experts) and the tp group's token policy; then tp.py's glue, which
    sums each router's gradient over the group."""
    rank, n = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(n)][rank]  # with expert tp, no expert parallelism
    for layer in model.layers:
        layer.mlp = ep.ExpertParallelMoE(layer.mlp, alone if expert_tp else None, None, router="gate",
                                         shared="shared_expert", shared_gate="shared_expert_gate",
                                         tokens=ep.ShardedTokens(None) if sp else ep.ReplicatedTokens(None),
                                         expert_tp=ep.SplitExperts(None) if expert_tp else ep.WholeExperts())
        if expert_tp:
            tp.split_experts(layer.mlp, None, **SWIGLU)
    return glue_tp(tp, model, None, sp)


def ep_over_tp_worker(folder, sequence_parallel, expert_tp):
    tp, ep = import_copy(folder, "tp.py"), import_copy(folder, "ep.py")
    ref, ids, ref_loss, ref_grads = reference(moe=True)
    model = fresh_copy(ref)
    loss_fn = glue_ep_over_tp(tp, ep, model, sequence_parallel, expert_tp)
    loss = loss_fn(model(ids[:, :-1], torch.arange(SEQ)), ids[:, 1:])
    loss.backward()
    layouts = tp.sharded_layouts(model)
    grads = {name: tp.unshard(p.grad, layouts[name][0], None, layouts[name][1]) if name in layouts else p.grad
             for name, p in model.named_parameters()}
    return abs(loss.item() - ref_loss), max(worst(grads[k], ref_grads[k]) for k in grads), sorted(grads)


@pytest.mark.parametrize("sequence_parallel,expert_tp", [(False, False), (True, False), (False, True)],
                         ids=["tp2-ep2", "tp2-sp-ep2", "tp2-expert-tp2"])
def test_ep_folded_over_tp_on_a_llama_moe(tmp_path, sequence_parallel, expert_tp):
    """The Llama's SwiGLU experts spread over the tp ranks, or split over them (expert tensor parallelism),
    its router `gate` summed over tp by tp.py's split_moe: loss and every gradient as on one process."""
    folder = copy_alone("tp.py", tmp_path)
    shutil.copy(os.path.join(REPO, "ep.py"), folder)
    results = run_on_ranks(2, ep_over_tp_worker, folder, sequence_parallel, expert_tp)
    for loss_error, grad_error, _ in results:
        assert loss_error < 1e-12 and grad_error < 1e-12
    assert set(results[0][2]) | set(results[1][2]) == {name for name, _ in Llama(moe=True).named_parameters()}


def forgotten_token_policy_worker(folder):
    tp, ep = import_copy(folder, "tp.py"), import_copy(folder, "ep.py")
    model = fresh_copy(reference(moe=True)[0])
    with pytest.raises(ValueError) as unnamed:  # the shared expert's gate not named: it would not run
        ep.ExpertParallelMoE(model.layers[0].mlp, None, None, router="gate", shared="shared_expert")
    for layer in model.layers:
        layer.mlp = ep.ExpertParallelMoE(layer.mlp, None, None, router="gate", shared="shared_expert",
                                         shared_gate="shared_expert_gate")  # no tokens=
    glue_tp(tp, model, None, False)
    with pytest.raises(ValueError) as refusal:
        model(torch.zeros(BATCH, SEQ, dtype=torch.long), torch.arange(SEQ))
    return str(unnamed.value), str(refusal.value)


def test_ep_under_tp_without_a_token_policy_or_a_part_unnamed_is_refused(tmp_path):
    """Left out, each tp rank would route the same tokens (every token twice), and a shared expert's gate the
    glue did not name would not run: the layer refuses both instead."""
    folder = copy_alone("tp.py", tmp_path)
    shutil.copy(os.path.join(REPO, "ep.py"), folder)
    for unnamed, message in run_on_ranks(2, forgotten_token_policy_worker, folder):
        assert "the MoE layer's shared_expert_gate is none of" in unnamed and "shared_gate='shared_gate'" in unnamed
        assert "summed over 2 tensor-parallel ranks" in message and "ReplicatedTokens(tp_group)" in message


def one_kv_head_worker(folder):
    tp = import_copy(folder, "tp.py")
    model = Llama()
    for layer in model.layers:  # multi-query attention: one key/value head for the four query heads
        attention = layer.self_attn
        attention.k_proj, attention.v_proj = (nn.Linear(D, attention.head_dim, bias=False) for _ in range(2))
    with pytest.raises(ValueError) as refusal:
        glue_tp(tp, model, None, False)
    return str(refusal.value)


def test_tp_refuses_fewer_key_value_heads_than_ranks(tmp_path):
    """Split, not at the first forward with a shape error: one key/value head does not divide over 2 ranks."""
    folder = copy_alone("tp.py", tmp_path)
    for message in run_on_ranks(2, one_kv_head_worker, folder):
        assert "a block of 1 head of width 4 does not divide by the tensor-parallel size 2" in message


# -- dp.py -----------------------------------------------------------------------------------

def llama_moe_with_a_starved_expert():
    torch.manual_seed(0)
    model = Llama(moe=True).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.bias[3] = -1e3  # no token ever chooses expert 3
    return model


def dp_worker(folder):
    dp = import_copy(folder, "dp.py")
    rank, n, steps = dist.get_rank(), dist.get_world_size(), 3
    ref = llama_moe_with_a_starved_expert()
    model = copy.deepcopy(ref)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5)
    for ids in batches:
        cross_entropy(ref(ids[:, :-1], torch.arange(SEQ)), ids[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    sync = dp.DataParallel(model.parameters(), find_unused_parameters=True)  # glue
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for ids in batches:
        mine = ids.chunk(n)[rank]
        cross_entropy(model(mine[:, :-1], torch.arange(SEQ)), mine[:, 1:]).backward()
        sync.finish_grad_sync()  # glue
        opt.step()
        opt.zero_grad()
    initial = llama_moe_with_a_starved_expert()
    starved = [name for name, _ in model.named_parameters() if ".experts.3." in name]
    untouched = all(torch.equal(dict(model.named_parameters())[name], dict(initial.named_parameters())[name])
                    for name in starved)
    return max(worst(a, b) for a, b in zip(model.parameters(), ref.parameters())), untouched


def test_dp_on_a_llama_moe_with_an_expert_no_token_reaches(tmp_path):
    folder = copy_alone("dp.py", tmp_path)
    for error, untouched in run_on_ranks(2, dp_worker, folder):
        assert error < 1e-12
        assert untouched  # no gradient anywhere: AdamW left it alone (no weight decay), as on one device
