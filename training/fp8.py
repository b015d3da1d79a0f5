"""FP8 for the blocks' matrices, the same under every layout (docs/precision.md, "FP8").

Every linear layer of attention, the MLP and the experts (shared ones too) computes its three products in
float8: y = x Wᵀ forward, dX = dY W and dW = dYᵀ x backward. An operand is quantised by a scale, a maximum
of |values| over part of it: each row of it along the dimension the product sums over (rowwise), or the
whole tensor (tensorwise). The embedding, the output layer, the router, the norms and the optimizer are
untouched.

A layout splits tensors, and the scales are defined on the one device's, the logical tensor
(DESIGN.md: "FP8: scales over the logical tensor"): where tensor parallelism (or expert tensor parallelism)
splits the part a maximum runs over, the rank's maxima are reduced (MAX) over the group first, so each rank
quantises its slice exactly as one device quantises it. A row-parallel layer's summed dimension, the input
features, is split: its input's per-token maxima and its weight's per-output-feature maxima are reduced in
forward. A column-parallel layer's output features are split: in backward, where dX sums over them, the
output gradient's per-token maxima and the weight's per-input-feature maxima are. A token's row is never
split by data, context or pipeline parallelism, so rowwise scales need nothing else and the rowwise recipe
is the same under every layout. Tensorwise maxima span the tokens, which those layouts do split: they stay
the rank's micro-batch's (as every framework's do), and that is its whole distance from one device.

  rowwise     per-row scales, e4m3 for every operand; the weight gradient, which sums over the tokens (a
              dimension data, context and pipeline parallelism split), in the run's dtype (torchao's
              "rowwise with high-precision weight gradient")
  tensorwise  one scale a tensor, e4m3 forward, e5m2 for the output gradient (its range is wider than its
              precision needs); all three products in float8

Scales are powers of two, 2^ceil(log2(amax / largest float8)): dividing by one is exact, so the float8
value of an element depends only on it and its maximum. A zero maximum quantises to zeros; nothing
overflows (values are clamped to the largest float8 before the cast: CUDA's cast of a larger one is NaN).

On a GPU the products run on torch._scaled_mm, which sums in float32; on a CPU they are written out, summed
in float32 alike. In a float64 run (the equivalence tests) they are summed in float64 instead, from the same
float8 operands: a float32 sum in another order would move an element across a float8 rounding boundary now
and then, which is what the layouts are to be held to not doing. Each layer saves its input as it did and quantises it again in backward: FP8 keeps no
activations of its own. The maxima's reductions are counted in `comm_bytes` (logged as comm_fp8_*).
"""
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

import tp
from dp import ring_bytes_sent

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
comm_bytes = Counter()  # bytes this rank sent reducing maxima, per collective kind
NOT_FP8 = ("router", "shared_gate")  # linears of a block that stay in the run's dtype (ep.py's default names)


class Split:
    """The groups splitting a linear layer's logical weight (out, in): its input features (row-parallel) or
    its output features (column-parallel); None where nothing splits it."""

    def __init__(self, inputs=None, outputs=None):
        self.inputs, self.outputs = inputs, outputs
        self.weight = inputs or outputs


def maxima(t, group, whole=False):
    """max |t| of each row (whole: of the tensor), float32, over the ranks of group too."""
    if whole:
        largest = t.abs().amax() if t.numel() else t.new_zeros(())  # (an expert may receive no token)
    else:
        largest = t.abs().amax(dim=-1, keepdim=True)
    return largest.float() if group is None else largest_over(largest.float(), group)


@torch.compiler.disable  # communication runs eagerly under torch.compile, counted as it goes (as tp.py's)
def largest_over(largest, group):
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    comm_bytes["all_reduce"] += ring_bytes_sent("all_reduce", largest.nbytes, dist.get_world_size(group))
    return largest


def quantise(t, largest, dtype):
    """(t in float8 `dtype`, contiguous, and its scale): t / scale fits, scale a power of two per maximum."""
    top = torch.finfo(dtype).max
    scale = torch.exp2(torch.ceil(torch.log2(largest.clamp(min=torch.finfo(torch.float32).tiny) / top)))
    return (t / scale).clamp(-top, top).to(dtype).contiguous(), scale


def scaled_product(a, a_scale, b, b_scale, out_dtype):
    """(a * a_scale) (b * b_scale)ᵀ in out_dtype, a (M, K) and b (N, K) float8 with scales (M, 1) and (N, 1)
    or one each: summed in float64 for float64; on a GPU by torch._scaled_mm (in float32), K and N padded with
    zeros to the multiples of 16 its CUDA kernels take; on a CPU written out, summed in float32 as _scaled_mm
    sums (its CPU kernel takes rowwise scales in some releases and some runs only: torch 2.11's has two
    paths, one of which refuses them)."""
    if out_dtype == torch.float64 or a.device.type == "cpu":
        wide = torch.float64 if out_dtype == torch.float64 else torch.float32
        return ((a.to(wide) * a_scale.to(wide)) @ (b.to(wide) * b_scale.to(wide)).t()).to(out_dtype)
    n = b.shape[0]
    a, b = (_padded(t, 1) for t in (a, b))
    b = _padded(b, 0)
    b_scale = _padded(b_scale, 0, value=1.0) if b_scale.dim() else b_scale
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t().contiguous(), out_dtype=out_dtype)
    # a copy where N was padded (no padded storage outlives the product), else the product itself, not a view
    return out if out.shape[1] == n else out[:, :n].contiguous()


def _padded(t, dim, value=0.0):
    extra = -t.shape[dim] % 16
    if not extra:
        return t
    pad = torch.full((*t.shape[:dim], extra, *t.shape[dim + 1:]), value, dtype=torch.float32, device=t.device)
    return torch.cat([t, pad.to(t.dtype)], dim=dim)


class Rowwise:
    """A scale per row along the summed dimension: per token for activations and output gradients, per
    output feature (forward) or input feature (dX) for the weight; dW = dYᵀ x in the run's dtype."""

    name = "rowwise"

    def forward(self, x, weight, split):
        return scaled_product(*self.rows(x, split.inputs), *self.rows(weight, split.inputs), x.dtype)

    def backward(self, grad, x, weight, split):
        grad_x = scaled_product(*self.rows(grad, split.outputs), *self.rows(weight.t(), split.outputs), grad.dtype)
        return grad_x, grad.t() @ x

    @staticmethod
    def rows(t, group):
        return quantise(t, maxima(t, group), E4M3)


class Tensorwise:
    """One scale a tensor, its maximum reduced over the group splitting it; e5m2 for the output gradient."""

    name = "tensorwise"

    def forward(self, x, weight, split):
        return scaled_product(*self.whole(x, split.inputs), *self.whole(weight, split.weight), x.dtype)

    def backward(self, grad, x, weight, split):
        grad8, grad_scale = self.whole(grad, split.outputs, E5M2)
        weight8, weight_scale = self.whole(weight, split.weight)
        x8, x_scale = self.whole(x, split.inputs)
        grad_x = scaled_product(grad8, grad_scale, weight8.t().contiguous(), weight_scale, grad.dtype)
        grad_weight = scaled_product(grad8.t().contiguous(), grad_scale, x8.t().contiguous(), x_scale, grad.dtype)
        return grad_x, grad_weight

    @staticmethod
    def whole(t, group, dtype=E4M3):
        return quantise(t, maxima(t, group, whole=True), dtype)


RECIPES = {recipe.name: recipe for recipe in (Rowwise(), Tensorwise())}


class Float8Product(Function):
    """x Wᵀ (tokens, out) for x (..., in), by `recipe` over `split`; saves x and W as they are, as F.linear does
    (a token-major copy of a strided x, made for the product, is not kept).

    Its output is a tensor of its own, never a view: autograd forbids writing in place into a view that a
    custom Function returns (a shared expert's output, into which the routed experts' are added, is one)."""

    @staticmethod
    def forward(ctx, x, weight, recipe, split):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.split = recipe, split
        return recipe.forward(x.reshape(-1, x.shape[-1]), weight, split)  # (tokens, out)

    @staticmethod
    def backward(ctx, grad):  # grad: (tokens, out)
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = ctx.recipe.backward(grad.contiguous(), x.reshape(-1, x.shape[-1]), weight, ctx.split)
        return grad_x.view(x.shape), grad_weight.to(weight.dtype), None, None


def float8_linear(x, weight, bias, recipe, split):
    """F.linear(x, weight, bias) with its products in float8."""
    y = Float8Product.apply(x, weight, recipe, split).view(*x.shape[:-1], weight.shape[0])  # (..., out)
    return y if bias is None else y + bias


class Float8Linear(nn.Linear):
    """nn.Linear in float8 (a layer no layout splits, or one that ZeRO gathers whole)."""

    def forward(self, x):
        return float8_linear(x, self.weight, self.bias, self.recipe, Split())


class Float8ColumnParallelLinear(tp.ColumnParallelLinear):
    """tp.ColumnParallelLinear in float8: dX's maxima reduced over the group splitting the output features."""

    def forward(self, x):
        x = x if self.entered else self.plan.enter(x)
        return float8_linear(x, self.weight, self.bias, self.recipe, Split(outputs=self.plan.group))


class Float8RowParallelLinear(tp.RowParallelLinear):
    """tp.RowParallelLinear in float8: the forward's maxima reduced over the group splitting the input features."""

    def forward(self, x):
        y = self.plan.leave(float8_linear(x, self.weight, None, self.recipe, Split(inputs=self.plan.group)))
        return y if self.bias is None else y + self.plan.replicated(self.bias)


IN_FLOAT8 = {nn.Linear: Float8Linear, tp.ColumnParallelLinear: Float8ColumnParallelLinear,
             tp.RowParallelLinear: Float8RowParallelLinear}


def apply_fp8(model, recipe):
    """Every linear layer of the blocks this rank holds, but the routers and shared experts' gates, computes in
    float8 by `recipe` (a name of RECIPES), in place: the same parameters under the same names."""
    for block in model.blocks:
        for name, module in block.named_modules():
            if type(module) in IN_FLOAT8 and name.rsplit(".", 1)[-1] not in NOT_FP8:
                module.__class__, module.recipe = IN_FLOAT8[type(module)], RECIPES[recipe]
    return model
