"""The gated delta rule (Gated DeltaNet's recurrence) with an initial and a final state.

Per head, with a state ``S`` (key dim x value dim), decays ``a_t = exp(g_t)`` and write
strengths ``beta_t``:

    S_t = a_t S_{t-1} + beta_t k_t^T (v_t - a_t k_t S_{t-1}),    o_t = q_t S_t

(``q``, ``k`` L2-normalised per head as FLA does, ``q`` scaled by ``dk^-1/2``: torchtitan's
and FLA's ``use_qk_l2norm_in_kernel``), computed in fp32 (fp64 for fp64 inputs).
:func:`chunk_gated_delta_rule` computes it a chunk of positions at a time in pure torch (the
CPU path and the reference); on CUDA with FLA installed, :func:`gated_delta_rule` calls FLA's
``chunk_gated_delta_rule`` with ``initial_state`` and ``output_final_state``.
:func:`recurrent_gated_delta_rule` is the step-by-step definition the tests hold both to.

Within a chunk, with ``G_t`` the cumulative log decay from the chunk's start, the state is
``S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} k_s^T u_s`` where the corrections ``u`` solve
the unit lower-triangular system ``(I + A) U = beta V - beta e^{G} K S_0`` with
``A_ts = beta_t e^{G_t - G_s} k_t.k_s`` (s < t); the outputs are
``O = e^{G} Q S_0 + (Q K^T * D) U`` with ``D_ts = e^{G_t - G_s}`` (s <= t), and the chunk's
final state ``e^{G_C} S_0 + (K e^{G_C - G})^T U``. Every exponent is <= 0 (decays are <= 1).

The state after any position is affine in the initial state, ``S_t = P_t S_0 + B_t`` with
``P_t`` a (key dim x key dim) product of ``a_s (I - beta_s k_s^T k_s)``:
:func:`gated_delta_rule_affine` returns that map over a run of positions (for the scan over
context-parallel ranks, :mod:`seq1f1b.attention.carried_cp`).

``backend="op"`` runs the recurrence as one opaque op pair, ``seq1f1b::gated_delta_rule``
and its backward, which keep only their inputs for the backward and recompute the rest, as
FLA's fused kernel does. A dry run (fake tensors, :mod:`seq1f1b.planning.dryrun`) takes it
under ``"auto"``: its fake kernels give the shapes at once where the pure-torch chunks would
dispatch some 30 fake ops a chunk (512 chunks a 32k sequence), and the memory it shows is the
fused kernel's a GPU holds, not the chunked graph's. Its FLOPs are priced by
:func:`_delta_rule_flops` (torch's ``flop_counter`` registry).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from .. import _runtime as rt
from .carried import Piece

__all__ = [
    "chunk_gated_delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_affine",
    "gated_delta_rule_pieces",
    "recurrent_gated_delta_rule",
]

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + 1e-6)`` per head, FLA's (and transformers') normalisation: the eps
    sits under the root, so a short vector (a freshly initialised layer's) stays short."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _normalised(q: torch.Tensor, k: torch.Tensor, l2norm: bool) -> tuple[torch.Tensor, ...]:
    """``q``, ``k`` in the compute dtype (fp32, fp64 for fp64 inputs), normalised, q scaled."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence position by position (the definition; slow). ``q``, ``k``: (B, L, H,
    dk); ``v``: (B, L, H, dv); ``g``, ``beta``: (B, L, H); state (B, H, dk, dv), fp32.
    Returns the output (B, L, H, dv, in ``v``'s dtype) and the final state."""
    q, k = _normalised(q, k, l2norm)
    b, length, h, dk = k.shape
    f = q.dtype
    s = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(f)
    outs = []
    for t in range(length):
        s = s * g[:, t].to(f).exp()[..., None, None]
        kt, vt = k[:, t], v[:, t].to(f)
        delta = (vt - torch.einsum("bhk,bhkv->bhv", kt, s)) * beta[:, t].to(f)[..., None]
        s = s + torch.einsum("bhk,bhv->bhkv", kt, delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, 1).to(v.dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    l2norm: bool = True,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence a chunk of ``chunk`` positions at a time (see the module), pure torch,
    fp32 inside; shapes as :func:`recurrent_gated_delta_rule`."""
    q, k = _normalised(q, k, l2norm)
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    # heads first: (B, H, L, d)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    vf, gf, bf = (t.to(q.dtype).transpose(1, 2) for t in (v, g, beta))
    s = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for a in range(0, length, chunk):
        e = min(a + chunk, length)
        qc, kc, vc, bc = q[:, :, a:e], k[:, :, a:e], vf[:, :, a:e], bf[:, :, a:e, None]
        # G_t in float64: a difference of two fp32 cumulative sums of strong decays (|G| in
        # the thousands) would keep only about 1e-4 of G_t - G_s
        cum64 = gf[:, :, a:e].double().cumsum(-1)
        diff = (cum64[..., :, None] - cum64[..., None, :]).to(q.dtype)  # G_t - G_s
        cum = cum64.to(q.dtype)
        n = e - a
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, float("-inf")).exp()  # D (s <= t), 0 above
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        system = eye + (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc * vc - (bc * cum.exp()[..., None] * kc) @ s
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append((cum.exp()[..., None] * qc) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        to_end = (cum64[..., -1:] - cum64).to(q.dtype)  # G_C - G_s
        s = (
            cum[..., -1:].exp()[..., None] * s
            + (kc * to_end.exp()[..., None]).transpose(-1, -2) @ u
        )
    out = torch.cat(outs, 2) if outs else vf
    return out.transpose(1, 2).to(v.dtype), s


def _state_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("seq1f1b::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` as one op: the output (``v``'s dtype) and the final
    state (fp32, fp64 for fp64 inputs)."""
    with torch.no_grad():
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, l2norm=l2norm)
    return out.contiguous(), final.contiguous()


@gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, initial_state, l2norm):
    b, _, h, dk = k.shape
    return torch.empty_like(v), q.new_empty((b, h, dk, v.shape[-1]), dtype=_state_dtype(q))


@torch.library.custom_op("seq1f1b::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward_op(
    grad_out: torch.Tensor,
    grad_final: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    l2norm: bool,
) -> list[torch.Tensor]:
    """The gradients of :func:`gated_delta_rule_op` for ``q, k, v, g, beta`` and the
    initial state (zeros when there is none), recomputed from its inputs."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    init = None if initial_state is None else initial_state.detach().requires_grad_()
    with torch.enable_grad(), rt.autograd_inside_custom_op():
        out, final = chunk_gated_delta_rule(*leaves, init, l2norm=l2norm)
        inputs = leaves + ([] if init is None else [init])
        grads = torch.autograd.grad((out, final), inputs, (grad_out, grad_final), allow_unused=True)
    grads = [
        torch.zeros_like(t) if d is None else d.to(t.dtype)
        for t, d in zip(inputs, grads, strict=True)
    ]
    if init is None:
        grads.append(grad_final.new_zeros(()))
    return [d.contiguous() for d in grads]


@gated_delta_rule_backward_op.register_fake
def _(grad_out, grad_final, q, k, v, g, beta, initial_state, l2norm):
    state = grad_final.new_zeros(()) if initial_state is None else torch.empty_like(initial_state)
    return [torch.empty_like(t) for t in (q, k, v, g, beta)] + [state]


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, initial_state, l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state)  # type: ignore[attr-defined]
    ctx.l2norm = l2norm  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: torch.Tensor, grad_final: torch.Tensor) -> tuple:
    # torch materialises an unused output's gradient as zeros: neither is None here
    q, k, v, g, beta, initial_state = ctx.saved_tensors  # type: ignore[attr-defined]
    l2norm: bool = ctx.l2norm  # type: ignore[attr-defined]
    *grads, d_init = gated_delta_rule_backward_op(
        grad_out, grad_final, q, k, v, g, beta, initial_state, l2norm
    )
    return (*grads, None if initial_state is None else d_init, None)


gated_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


def _delta_rule_flops(q_shape, k_shape, v_shape, *_: object, backward: bool = False) -> int:
    """The chunked algorithm's FLOPs (module docstring), per chunk of ``C`` positions and
    head: ``K K^T`` and ``Q K^T`` (``2 C^2 dk`` each), the triangular solve (``C^2 dv``),
    ``K S_0``, ``Q S_0``, the state update (``2 C dk dv`` each) and ``(Q K^T * D) U``
    (``2 C^2 dv``); the backward counted as twice the forward, as for a matrix product."""
    b, length, h, dk = k_shape
    dv = v_shape[-1]
    c = min(CHUNK, length)
    per_position = 4 * c * dk + 3 * c * dv + 6 * dk * dv
    return (2 if backward else 1) * b * h * length * per_position


@register_flop_formula(torch.ops.seq1f1b.gated_delta_rule)
def _(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _delta_rule_flops(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.seq1f1b.gated_delta_rule_backward)
def _(grad_out_shape, grad_final_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
      **kwargs) -> int:  # fmt: skip
    return _delta_rule_flops(q_shape, k_shape, v_shape, backward=True)


def _fla_available(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    l2norm: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence with an initial state, returning the output and the final state:
    FLA's chunked kernel on CUDA when FLA is installed (``backend="auto"`` or ``"fla"``),
    the opaque op pair for fake tensors (``"auto"``) or when asked (``"op"``), else
    :func:`chunk_gated_delta_rule` (``"torch"``)."""
    if backend == "fla" or (backend == "auto" and _fla_available(q)):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        out, final = fla_chunk(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        return out, final
    if backend == "op" or (backend == "auto" and rt.is_fake(q)):
        return gated_delta_rule_op(q, k, v, g, beta, initial_state, l2norm)
    if backend not in ("auto", "torch"):
        raise ValueError(
            f"gated_delta_rule(backend={backend!r}): use 'auto', 'fla', 'op' or 'torch'"
        )
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state, l2norm=l2norm)


def gated_delta_rule_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    pieces: Sequence[Piece],
    *,
    l2norm: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` restarted at every document start: each piece starts from the
    carried ``initial_state`` of its rows when it continues an earlier segment's document,
    else from zeros. Returns the output and, per row, the state after the row's last piece
    (what the next segment continues)."""
    if len(pieces) == 1 and pieces[0].a == 0 and pieces[0].b == q.shape[1]:
        init = initial_state if pieces[0].continues else None
        return gated_delta_rule(q, k, v, g, beta, init, l2norm=l2norm, backend=backend)
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    finals: dict[tuple[int, int], torch.Tensor] = {}
    for p in sorted(pieces, key=lambda p: (p.r0, p.a)):
        init = initial_state[p.r0 : p.r1] if p.continues and initial_state is not None else None
        sl = (slice(p.r0, p.r1), slice(p.a, p.b))
        out, fin = gated_delta_rule(
            q[sl], k[sl], v[sl], g[sl], beta[sl], init, l2norm=l2norm, backend=backend
        )
        rows.setdefault((p.r0, p.r1), []).append(out)
        finals[p.r0, p.r1] = fin
    keys = sorted(rows)
    out = torch.cat([torch.cat(rows[key], 1) for key in keys], 0)
    return out, torch.cat([finals[key] for key in keys], 0)


def _uses_fla(q: torch.Tensor, backend: str) -> bool:
    return backend == "fla" or (backend == "auto" and _fla_available(q))


def gated_delta_rule_affine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pieces: Sequence[Piece],
    *,
    l2norm: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule_pieces` from an initial state ``S`` not yet known, as affine
    maps of it: ``(o0, qp, trans, add)`` with output ``o0 + qp S`` (``o0`` (B, L, H, dv),
    ``qp`` (B, L, H, dk), per row and head) and final state ``trans S + add`` (``trans``
    (B, H, dk, dk), ``add`` (B, H, dk, dv)). One call: the values get ``dk`` zero columns
    whose initial state is the identity, so the state's extra columns are ``P_t`` and their
    outputs ``q_t P_t`` (pieces that open a document start from zeros: their part of
    ``qp`` and their rows' ``trans`` are zero). The outputs are in the compute dtype (fp32;
    FLA's kernel: ``v``'s)."""
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    fla = _uses_fla(q, backend)
    compute = torch.promote_types(q.dtype, torch.float32)
    dtype = v.dtype if fla else torch.promote_types(v.dtype, torch.float32)
    ext = torch.cat([v.to(dtype), v.new_zeros((b, length, h, dk), dtype=dtype)], -1)
    eye = torch.eye(dk, dtype=compute, device=q.device).expand(b, h, dk, dk)
    init = torch.cat([eye.new_zeros(b, h, dk, dv), eye], -1)
    out, final = gated_delta_rule_pieces(
        q, k, ext, g, beta, init, pieces, l2norm=l2norm, backend=backend
    )
    return out[..., :dv], out[..., dv:], final[..., dv:], final[..., :dv]
