"""A chunk-aware Gated DeltaNet layer (Qwen3.5's and Qwen3-Next's linear attention).

The layer projects queries, keys, values, an output gate and the two gating signals, runs a
short causal convolution over the q/k/v channels, the gated delta rule, a gated RMSNorm and
the output projection. Under a Seq1F1B schedule it carries two states from segment to segment
of a sample (:mod:`seq1f1b.attention.carried`): the convolution's last inputs and the
delta-rule state; a packed row restarts both at each document. Under context parallelism
both also pass from CP rank to CP rank within a segment, by a scan over the ranks
(:mod:`seq1f1b.attention.carried_cp`). Model adapters that keep their
own projections call :func:`gated_deltanet_core` with them instead.

Under torch.compile the core is one opaque custom op pair, as the compiled attention is
(:mod:`seq1f1b.attention.attention_op`): ``seq1f1b::gated_deltanet`` runs it when the op runs
(reading the unit, keeping the state for the next segment, nothing traced or guarded) and
``seq1f1b::gated_deltanet_backward`` recomputes it from its inputs under the backward's unit
and differentiates it, so the state's gradient flows as in eager mode and no graph is held
between the two (a checkpointed block keeps only the op's inputs). The layer is named by its
``seq1f1b_layer_key`` buffer (:func:`seq1f1b.add_layer_key`), eager and compiled alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _runtime as rt
from .attention_op import LAYER_KEY, add_layer_key, layer_key_of
from .carried import CarriedState, carried_state
from .carried_cp import affine_scan, scan_layout
from .causal_conv import causal_conv1d, tail_transition
from .gated_delta import gated_delta_rule_affine, gated_delta_rule_pieces

__all__ = ["ChunkAwareGatedDeltaNet", "gated_deltanet_core"]


def _state_key(layer: Hashable) -> Hashable:
    """The carried state's key: the layer's key buffer when it has one (the compiled op sees
    only the buffer), else the layer itself."""
    key = getattr(layer, LAYER_KEY, None)
    return _key_of(key) if isinstance(key, torch.Tensor) else layer


def _key_of(layer_key: torch.Tensor) -> Hashable:
    if rt.is_fake(layer_key):  # a dry run's buffers share data pointer 0: the buffer itself
        return ("carried", id(layer_key))
    return ("carried", layer_key.untyped_storage().data_ptr())


def gated_deltanet_core(
    layer: Hashable,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    head_dims: tuple[int, int, int, int],
    *,
    anchor: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated DeltaNet from the projected, not yet convolved ``qkv`` (B, L, Hk*dk + Hk*dk +
    Hv*dv) to the delta rule's output (B, L, Hv, dv), carrying the convolution's tail and the
    state across segments. ``conv_weight``: (channels, 1, W); ``g`` (log decay, <= 0) and
    ``beta``: (B, L, Hv); ``head_dims``: (Hk, dk, Hv, dv); keys and queries are repeated to
    ``Hv`` heads. ``layer`` names the layer's carried state on its stage (under
    torch.compile a module with a key buffer, :func:`seq1f1b.add_layer_key`); ``anchor`` is
    the layer's input (see :meth:`CarriedState.initial`)."""
    if torch.compiler.is_compiling():
        return gated_deltanet_op(
            qkv, conv_weight, g, beta, layer_key_of(layer), list(head_dims), backend
        )
    return _core(_state_key(layer), qkv, conv_weight, g, beta, head_dims, anchor, backend)


def _core(
    key: Hashable,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    head_dims: Sequence[int],
    anchor: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    b, length, _ = qkv.shape
    carry = carried_state(key)
    init = carry.initial(anchor)
    tail, state = (None, None) if init is None else init
    if carry.context_parallel() is not None:
        return _core_cp(carry, qkv, conv_weight, g, beta, head_dims, tail, state, backend)
    pieces = carry.pieces(b, length)
    mixed, new_tail = causal_conv1d(qkv, conv_weight, tail, pieces)
    q, k, v = _split_heads(mixed, head_dims)
    out, final = gated_delta_rule_pieces(q, k, v, g, beta, state, pieces, backend=backend)
    return carry.keep(out, new_tail, final)


def _split_heads(
    mixed: torch.Tensor, head_dims: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved channels as q, k (repeated to the value heads) and v, heads apart."""
    n_k, dk, n_v, dv = head_dims
    b, length, _ = mixed.shape
    q, k, v = mixed.split((n_k * dk, n_k * dk, n_v * dv), dim=-1)
    q, k = q.view(b, length, n_k, dk), k.view(b, length, n_k, dk)
    if n_v != n_k:
        q, k = q.repeat_interleave(n_v // n_k, dim=2), k.repeat_interleave(n_v // n_k, dim=2)
    return q, k, v.reshape(b, length, n_v, dv)


def _core_cp(
    carry: CarriedState,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    head_dims: Sequence[int],
    tail: torch.Tensor | None,
    state: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """:func:`_core` on this rank's shard of a context-parallel segment: its runs of
    positions start from the convolution tail and the delta-rule state the runs before them
    (on other ranks) end with, passed by :func:`seq1f1b.attention.carried_cp.affine_scan`
    (the convolution's tails first, then the delta rule's states)."""
    _, dk, n_v, _ = head_dims
    b = qkv.shape[0]
    assert carry.unit is not None
    layout = scan_layout(carry.unit.info)
    docs = carry.unit.info.documents
    parts = [(layout.runs[j].lo, layout.runs[j].lo + layout.runs[j].length) for j in layout.mine]
    pieces = [layout.pieces(j, b, docs) for j in layout.mine]
    width = conv_weight.shape[-1]
    tails = [
        tail_transition(qkv[:, lo:hi], p, width) for (lo, hi), p in zip(parts, pieces, strict=True)
    ]
    x, starts, new_tail = affine_scan(
        layout, qkv, None if tail is None else tail.unsqueeze(1),
        [(m.unsqueeze(1), e.unsqueeze(1)) for m, e in tails],
    )  # fmt: skip
    mixed = torch.cat(
        [
            causal_conv1d(x[:, lo:hi], conv_weight, t.squeeze(1), p)[0]
            for (lo, hi), t, p in zip(parts, starts, pieces, strict=True)
        ],
        1,
    )
    q, k, v = _split_heads(mixed, head_dims)
    wide = torch.promote_types(v.dtype, torch.float32)
    outs, maps, pairs = [], [], []
    for j, (lo, hi), p in zip(layout.mine, parts, pieces, strict=True):
        sl = (slice(None), slice(lo, hi))
        if j > 0 and any(piece.continues for piece in p):
            o0, qp, trans, add = gated_delta_rule_affine(
                q[sl], k[sl], v[sl], g[sl], beta[sl], p, backend=backend
            )
        else:  # the segment's first run starts from the carried state, which every rank
            # holds; a run whose rows all open a document here depends on no start state
            o0, add = gated_delta_rule_pieces(
                q[sl], k[sl], v[sl], g[sl], beta[sl], state if j == 0 else None, p,
                backend=backend,
            )  # fmt: skip
            qp, trans = None, add.new_zeros((b, n_v, dk, dk))
        outs.append(o0.to(wide))
        maps.append(qp)
        pairs.append((trans, add))
    o0, starts, final = affine_scan(layout, torch.cat(outs, 1), state, pairs)
    out = []
    for (lo, hi), qp, s in zip(parts, maps, starts, strict=True):
        o = o0[:, lo:hi]
        if qp is not None:
            o = o + torch.einsum("blhk,bhkv->blhv", qp.to(s.dtype), s).to(wide)
        out.append(o)
    return carry.keep(torch.cat(out, 1).to(v.dtype), new_tail.squeeze(1), final)


def _out_shape(qkv: torch.Tensor, g: torch.Tensor, head_dims: Sequence[int]) -> torch.Tensor:
    return qkv.new_empty((*qkv.shape[:2], head_dims[2], head_dims[3]))


@torch.library.custom_op("seq1f1b::gated_deltanet", mutates_args=())
def gated_deltanet_op(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer_key: torch.Tensor,
    head_dims: list[int],
    backend: str,
) -> torch.Tensor:
    """The compiled form of :func:`gated_deltanet_core` (see the module): no graph kept."""
    if qkv.device.type == "meta":
        return _out_shape(qkv, g, head_dims)
    with torch.no_grad():
        out = _core(_key_of(layer_key), qkv, conv_weight, g, beta, head_dims, qkv, backend)
    return out.contiguous()


@gated_deltanet_op.register_fake
def _(qkv, conv_weight, g, beta, layer_key, head_dims, backend):
    return _out_shape(qkv, g, head_dims)


@torch.library.custom_op("seq1f1b::gated_deltanet_backward", mutates_args=())
def gated_deltanet_backward(
    grad_out: torch.Tensor,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer_key: torch.Tensor,
    head_dims: list[int],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_deltanet_op`: the core recomputed from its inputs under the
    running backward's unit (it reads the previous segment's state and wires this segment's
    to the gradient the next one left), then differentiated."""
    inputs = [t.detach().requires_grad_() for t in (qkv, conv_weight, g, beta)]
    with rt.autograd_inside_custom_op():
        out = _core(_key_of(layer_key), *inputs, head_dims, inputs[0], backend)
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return tuple(
        torch.zeros_like(t) if d is None else d.to(t.dtype).contiguous()
        for t, d in zip(inputs, grads, strict=True)
    )


@gated_deltanet_backward.register_fake
def _(grad_out, qkv, conv_weight, g, beta, layer_key, head_dims, backend):
    return tuple(torch.empty_like(t) for t in (qkv, conv_weight, g, beta))


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    qkv, conv_weight, g, beta, layer_key, head_dims, backend = inputs
    ctx.save_for_backward(qkv, conv_weight, g, beta, layer_key)
    ctx.head_dims, ctx.backend = head_dims, backend


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    qkv, conv_weight, g, beta, layer_key = ctx.saved_tensors
    grads = gated_deltanet_backward(
        grad_out, qkv, conv_weight, g, beta, layer_key, ctx.head_dims, ctx.backend
    )
    return (*grads, None, None, None)


gated_deltanet_op.register_autograd(_backward, setup_context=_setup_context)


class ChunkAwareGatedDeltaNet(nn.Module):
    """Gated DeltaNet on (B, L, dim) inputs, chunk-aware (see the module). ``n_key_heads``
    of ``key_dim`` for queries and keys, ``n_value_heads`` of ``value_dim`` for values (a
    multiple of the key heads), a convolution of ``conv_width`` taps. ``backend`` picks the
    delta rule's kernel (see :func:`seq1f1b.attention.gated_delta.gated_delta_rule`)."""

    def __init__(
        self,
        dim: int,
        n_key_heads: int,
        n_value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_width: int = 4,
        eps: float = 1e-6,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if n_value_heads % n_key_heads:
            raise ValueError(
                f"ChunkAwareGatedDeltaNet: n_value_heads={n_value_heads} must be a multiple of "
                f"n_key_heads={n_key_heads}"
            )
        self.head_dims = (n_key_heads, key_dim, n_value_heads, value_dim)
        self.backend = backend
        channels = 2 * n_key_heads * key_dim + n_value_heads * value_dim
        self.in_proj_qkv = nn.Linear(dim, channels, bias=False)
        self.in_proj_z = nn.Linear(dim, n_value_heads * value_dim, bias=False)
        self.in_proj_a = nn.Linear(dim, n_value_heads, bias=False)
        self.in_proj_b = nn.Linear(dim, n_value_heads, bias=False)
        self.conv = nn.Conv1d(channels, channels, conv_width, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_value_heads).uniform_(0.0, 2.0).log())
        self.dt_bias = nn.Parameter(torch.empty(n_value_heads).uniform_(-1.0, 1.0))
        self.norm = nn.RMSNorm(value_dim, eps=eps)
        self.out_proj = nn.Linear(n_value_heads * value_dim, dim, bias=False)
        add_layer_key(self)  # names the layer's carried state under torch.compile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        _, _, n_v, dv = self.head_dims
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, fp64 for an fp64 model
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
        beta = torch.sigmoid(self.in_proj_b(x))
        out = gated_deltanet_core(
            self,
            self.in_proj_qkv(x),
            self.conv.weight,
            g,
            beta,
            self.head_dims,
            anchor=x,
            backend=self.backend,
        )
        z = self.in_proj_z(x).view(b, length, n_v, dv)
        out = self.norm(out) * F.silu(z)
        return self.out_proj(out.reshape(b, length, n_v * dv))
