"""Memory and time of one pipeline stage, per GPU, for the planner.

Why a separate module: the planner searches settings, this module prices one of them, and the
formulas are the part users argue with, so they are stated here in one place.

Precision: a setting computes either in bf16 (``b = 2``; fp32 master weights, gradients and
Adam moments) or in fp32 (``b = 4``), whichever its trainer will really run; the planner
decides which (:meth:`seq1f1b.planning.planner.Trainer.runs_in_bf16`), this module prices both.

Memory (bytes per GPU; ``b`` = activation dtype bytes, ``t`` = tensor-parallel degree with
sequence parallelism, so every activation and weight is split ``t`` ways):

* saved activations per token per layer, Llama block (RMSNorm, RoPE, SwiGLU, no dropout, flash
  attention so no score matrix)::

      b * (2H  norm inputs  + 2H  norm outputs  + h*d  Q  + 2*h_kv*d  K, V  + h*d  attention out
           + 4F  gate, up, silu(gate), silu*up)  +  4*h  fp32 log-sum-exp

  (``2F`` instead of ``4F`` for a plain two-matrix FFN); divided by ``t``. This is the
  ``FUSED`` profile of :mod:`seq1f1b.planning.saved` (``MemoryModel.saved``, the default);
  the others price what a trainer's kernels and tensor-parallel plan hold differently,
  measured against the dry run (torch's eager ops: fp32 norm copies on the CPU, the
  all-gathered sequence-parallel matmul inputs, the stage's inputs and outputs and sent
  gradients, the K/V gradients, the backward's temporaries, the embedding's gradient);
* full activation checkpointing (torchtitan ``mode = "full"``): only each layer's input, ``b*H``
  per token per layer, plus, with ``K > 1`` segments, the K/V of earlier segments that later
  segments read (``2*b*h_kv*d``; with the latent cache, multi-head latent attention's latent,
  ``b*(rank + rope)``; a sliding-window layer keeps of each segment only the last
  ``window - 1`` positions, plus the sinks); the backward of one unit recomputes one layer's
  activations of that unit on top (a transient);
* selective activation checkpointing (torchtitan ``mode = "selective"``, op-level, the default
  of its Llama configs; :func:`selective_ac_layer`): each block keeps its input, the attention
  output and every other matmul's output, and its backward recomputes the other matmuls and
  the elementwise work (0.2.2: ``wq wv w1 w2`` kept, ``wk wo w3`` recomputed; 0.3, whose Llama
  fuses ``wqkv``: ``wqkv w1 w2`` kept, ``wo w3`` recomputed);
* last stage: fp32 log-probabilities ``4*V`` per token in flight (the loss's saved state), plus
  the transient logits and, in bf16, their fp32 copy (``6*V``; ``4*V`` in fp32) for the unit
  being run; divided by ``t`` (torchtitan's loss-parallel output layer);
* model state: ``state_bytes_per_param`` (16: fp32 weights, gradients and two Adam moments) times
  the stage's parameters, divided by ``t`` and by the FSDP degree; on top, with FSDP:

  - without a pipeline, two layers' bf16 weights and gradients gathered at a time (FSDP
    reshards each layer after its forward and reduce-scatters after its backward);
  - with a pipeline, the whole stage's bf16 weights and fp32 accumulated gradients, unsharded
    (``2 + 4`` bytes per parameter, divided by ``t``): torchtitan's default
    ``fsdp_reshard_after_forward`` keeps weights gathered under PP, and torch's pipeline stage
    turns gradient sync off until the step's last backward, so FSDP accumulates every
    microbatch's gradients unsharded in its reduce dtype (fp32);

  the same at FSDP degree 1 where the trainer wraps every model in FSDP (torchtitan 0.3);
  the bf16 working copy of any other unsharded bf16 run (autocast's cast weights, Megatron's
  bf16 weights) is not counted;
* a rank's activation peak: each forward adds its unit's bytes (:meth:`MemoryModel.unit_bytes`)
  to its stage until the unit's backward, read along the rank's simulated order (all the
  rank's stages together), plus the largest transient of its stages.

Time (seconds): an action's FLOPs on its stage (:func:`action_work`: its blocks, causal
attention at the segment's position, and on the last stage the output layer) over
``t * flops_per_gpu`` (``Hardware.tflops`` in bf16, ``Hardware.fp32_throughput`` in fp32);
backward = 2 forwards, plus one forward with full recomputation; plus the tensor-parallel
collectives, not overlapped: 4 per layer per pass (2 all-gathers, 2 reduce-scatters of
``b*H`` per token) each moving ``(t-1)/t`` of its bytes at ``tp_bandwidth``. With a GPU
profile (:mod:`seq1f1b.planning.profiles`) three more terms are priced:

* pipeline send/receive: each forward not on the last stage sends its output and each
  backward not on the first stage its input gradient, ``b*H`` bytes per token divided by
  ``t`` (sequence parallelism scatters them), at ``Hardware.p2p_gbps`` (the inter-node link
  when the pipeline spans nodes), added to the sending action (the sender's stream waits);
  with Megatron-LM's blocking sends (``price(..., blocking_p2p=True)``) the transfer is
  priced instead where both ends meet
  (:func:`seq1f1b.planning.simulate.simulate_blocking`);
* FSDP all-gather (bf16 weights) and reduce-scatter (fp32 gradients), overlapped with compute
  as torchtitan runs them (:func:`fsdp_exposed_seconds`): only what the overlapping compute
  cannot hide is added to the step;
* a fixed overhead per action (launches, synchronisation, the per-unit bookkeeping) that
  makes many small segments slower than their FLOPs: ``ActionCosts``' ``overhead``.

Per action (what the planner simulates): an action's work is split into linear FLOPs (the
projections, the FFN and, on the last stage, the output layer ``2*s*H*V``), attention FLOPs
(``(s*P - s*s/2)*(4d+3)*h`` per layer), elementwise work (tokens times the widths the norms,
activations and the loss touch) and modules run, and each kind of action (F, B, I, W) has its
own seconds per unit of each plus a fixed overhead (:class:`ActionCosts`). From the hardware
figures: linear and attention FLOPs at the achieved throughput, B = 2 F, I = W = B / 2, no
elementwise or overhead term. Calibrated (:mod:`seq1f1b.planning.calibration`): all constants fitted
to measured per-action times, so what short segments cost real kernels is priced.

Context parallelism (``cp``): a rank holds ``1/cp`` of each sequence (head-tail balanced, so
every rank has ``1/cp`` of the causal work and of the activations) and its ring moves, per
layer per pass, the segment's own K/V (``cp-1`` hops of ``2*h_kv*d*b`` bytes per local token)
plus, for a segment with a cached prefix, the cheaper of passing the queries around (``cp-1``
hops of about ``2*h*d*b`` bytes per local token) or the prefix K/V; backward moves twice the
forward's bytes. Ring traffic is not assumed overlapped (conservative).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._runtime import ir as rt
from .._runtime.ir import Action
from ..schedules.partition import LatentKV, LinearAttention, ModelShape
from .saved import FUSED, SavedTensors

__all__ = [
    "FP32_SLOWDOWN",
    "PRESETS",
    "ActionCosts",
    "Coefficients",
    "Hardware",
    "MemoryModel",
    "SelectiveAC",
    "TimeModel",
    "Work",
    "action_work",
    "fsdp_exposed_seconds",
    "selective_ac_layer",
]

GB = 1e9
#: dense bf16 over fp32 peak: H100 SXM 989 / 67, A100 312 / 19.5. torch keeps TF32 off for
#: matmuls by default and torchtitan does not turn it on, so fp32 runs on the fp32 units.
FP32_SLOWDOWN = 15.0

#: Model shapes by name. Llama 3: Meta's published configs (torchtitan's ``llama3_args``);
#: Qwen3 dense: torchtitan 0.3's ``qwen3_configs`` (head dim 128 at every width); the
#: mixtures of experts as torchtitan 0.3 ships them, FLOPs by the active experts
#: (``ffn_hidden``: top k of them, plus the shared), weights by all (``ffn_total``):
#: Qwen3-30B-A3B (128 experts of 768, top 8), DeepSeek-V3 671B (MLA: one head dim, the mean of
#: q/k's 192 and v's 128, every head its own K/V; 3 dense layers of 18432, then 256 experts of
#: 2048, top 8, and one shared: widths averaged over the layers; its latent K/V: 512 + 64
#: values, expanded to 128 heads of 128 + 128), DeepSeek-V3 16B (torchtitan's ``16B``: the
#: same as read by the integration from its config), GPT-OSS 120B (128 experts of
#: 2880, top 4; 128-key windows on half the layers);
#: ``paper-7b``: the Seq1F1B paper's 7B (GPT-style FFN of 4H, vocabulary 50304, no GQA).
PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(4096, 32, 32, 128256, ffn_hidden=14336, n_kv_heads=8, gated_ffn=True),
    "llama3-70b": ModelShape(8192, 64, 80, 128256, ffn_hidden=28672, n_kv_heads=8, gated_ffn=True),
    "qwen3-8b": ModelShape(
        4096, 32, 36, 151936, ffn_hidden=12288, head_dim=128, n_kv_heads=8, gated_ffn=True
    ),
    "qwen3-32b": ModelShape(
        5120, 64, 64, 151936, ffn_hidden=25600, head_dim=128, n_kv_heads=8, gated_ffn=True
    ),
    "qwen3-30b-a3b": ModelShape(
        2048,
        32,
        48,
        151936,
        ffn_hidden=8 * 768,
        head_dim=128,
        n_kv_heads=4,
        gated_ffn=True,
        ffn_total=128 * 768,
    ),
    "deepseek-v3-671b": ModelShape(
        7168,
        128,
        61,
        129280,
        ffn_hidden=18432,
        head_dim=160,
        n_kv_heads=128,
        gated_ffn=True,
        ffn_total=round((3 * 18432 + 58 * 257 * 2048) / 61),
        latent_kv=LatentKV(512, 64, 128 * (128 + 128)),
    ),
    "deepseek-v3-16b": ModelShape(
        2048,
        16,
        27,
        102400,
        ffn_hidden=11252,
        head_dim=160,
        n_kv_heads=16,
        gated_ffn=True,
        ffn_total=89892,
        latent_kv=LatentKV(512, 64, 16 * (128 + 128)),
    ),
    # Qwen3.5: 3 of every 4 layers Gated DeltaNet (16 key heads of 128, value heads of 128),
    # the 4th gated full attention (head dim 256; its query gate is not priced)
    "qwen3.5-27b": ModelShape(
        5120,
        24,
        64,
        248320,
        ffn_hidden=17408,
        head_dim=256,
        n_kv_heads=4,
        gated_ffn=True,
        linear_attention=LinearAttention(48, 16, 48, 128, 128),
    ),
    "qwen3.5-397b-a17b": ModelShape(
        4096,
        32,
        60,
        248320,
        ffn_hidden=11 * 1024,
        head_dim=256,
        n_kv_heads=2,
        gated_ffn=True,
        ffn_total=513 * 1024,
        linear_attention=LinearAttention(45, 16, 64, 128, 128),
    ),
    "gpt-oss-120b": ModelShape(
        2880,
        64,
        36,
        201088,
        ffn_hidden=4 * 2880,
        head_dim=64,
        n_kv_heads=8,
        gated_ffn=True,
        window=128,
        window_layers=18,
        ffn_total=128 * 2880,
    ),
    "paper-7b": ModelShape(4096, 32, 32, 50304),
}


@dataclass(frozen=True)
class Hardware:
    """What one GPU offers; defaults are an H100 SXM at a typical 40% of its bf16 peak.

    ``inter_node_gbps``: achieved bandwidth per GPU between nodes of ``gpus_per_node``; with
    it the pipeline's send/receive and FSDP's collectives are priced (:meth:`link_gbps`),
    without it (the assumed-constants model) they are not. A GPU profile
    (:meth:`seq1f1b.planning.profiles.GpuProfile.hardware`) sets it from its links.
    """

    gpus: int
    memory_gb: float
    reserve_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    tflops: float = 400.0  # achieved dense bf16 TFLOP/s per GPU
    tp_gbps: float = 300.0  # achieved all-gather / reduce-scatter bandwidth inside a node
    #: achieved fp32 TFLOP/s for settings that run in fp32; None: ``tflops / FP32_SLOWDOWN``
    fp32_tflops: float | None = None
    cp_gbps: float | None = None  # achieved CP ring bandwidth; None: ``tp_gbps``
    inter_node_gbps: float | None = None
    gpus_per_node: int = 8
    #: pipeline sends reach this fraction of the link the collectives reach
    p2p_efficiency: float = 1.0

    @property
    def budget_bytes(self) -> float:
        return (self.memory_gb - self.reserve_gb) * GB

    @property
    def cp_bandwidth(self) -> float:
        return self.cp_gbps if self.cp_gbps is not None else self.tp_gbps

    @property
    def fp32_throughput(self) -> float:
        """Achieved fp32 TFLOP/s: given, or the bf16 figure scaled by the hardware ratio."""
        return self.fp32_tflops if self.fp32_tflops is not None else self.tflops / FP32_SLOWDOWN

    def link_gbps(self, span: int) -> float | None:
        """Achieved bandwidth of a group whose ranks lie ``span`` consecutive ranks apart or
        within (inside a node: ``tp_gbps``; across nodes: ``inter_node_gbps``); None when
        links are not priced."""
        if self.inter_node_gbps is None:
            return None
        return self.tp_gbps if span <= self.gpus_per_node else self.inter_node_gbps


@dataclass(frozen=True)
class Work:
    """What one action of one segment on one stage computes, at the model's full width.

    ``linear``: matmul FLOPs (projections, FFN, output layer); ``attention``: causal attention
    FLOPs; ``elements``: tokens times the widths elementwise kernels touch (norms, activations,
    residuals, the loss over the vocabulary) -- memory-bound work that FLOPs do not price;
    ``modules``: blocks run (plus one for the output layer and loss), for the per-module cost
    of launching kernels and running hooks, whatever the tokens.
    """

    linear: float
    attention: float
    elements: float
    modules: float = 0.0

    def scaled(self, factor: float) -> Work:
        """A share of the work (TP, CP); the modules still run on every rank."""
        return Work(
            self.linear * factor, self.attention * factor, self.elements * factor, self.modules
        )


def action_work(
    shape: ModelShape, layers: int, last: bool, s: int, end: int, latent: bool = False
) -> Work:
    """Forward work of ``layers`` blocks (plus the output layer and loss when ``last``) on a
    segment of ``s`` tokens ending at absolute position ``end`` (tokens ``end-s .. end-1``).

    ``latent``: the latent K/V cache re-expands the ``end - s`` earlier positions, once in the
    forward and three times' work in the backward (again, then the gradients of the latent and
    of the weights); priced as 4/3 of one expansion of forward work, so that the forward and
    its backward (twice a forward) add up to the four."""
    d, h, hidden = shape.head_dim, shape.n_heads, shape.hidden
    assert d is not None and shape.ffn_hidden is not None
    proj = 4 * hidden * d * (h + shape.n_kv_heads)
    mlp = (6 if shape.gated_ffn else 4) * hidden * shape.ffn_hidden
    soft = layers * shape.softmax_layers / shape.n_layers  # the stage's softmax layers
    linear = s * (soft * proj + layers * mlp) + (2 * s * hidden * shape.vocab if last else 0)
    if shape.linear_attention is not None:  # a hybrid's Gated DeltaNet layers (per token)
        linear += (layers - soft) * s * shape.linear_attention.flops_per_token(hidden)
    if latent and shape.latent_kv is not None:
        linear += layers * shape.latent_kv.expand_flops(end - s) * 4 / 3
    attention = soft * (s * end - s * s / 2) * (4 * d + 3) * h
    widths = layers * (4 * hidden + (2 if shape.gated_ffn else 1) * shape.ffn_hidden)
    elements = s * (widths + (shape.vocab if last else 0))
    return Work(float(linear), float(attention), float(elements), float(layers + int(last)))


@dataclass(frozen=True)
class Coefficients:
    """Seconds of one kind of action: per linear FLOP, per attention FLOP, per element, per
    module run, plus a fixed overhead per action (launches, Python, hooks)."""

    linear: float
    attention: float
    elements: float = 0.0
    overhead: float = 0.0
    per_module: float = 0.0

    def seconds(self, w: Work) -> float:
        return (
            self.linear * w.linear
            + self.attention * w.attention
            + self.elements * w.elements
            + self.per_module * w.modules
            + self.overhead
        )

    def scaled(self, factor: float) -> Coefficients:
        return Coefficients(
            self.linear * factor,
            self.attention * factor,
            self.elements * factor,
            self.overhead * factor,
            self.per_module * factor,
        )

    def plus(self, other: Coefficients) -> Coefficients:
        return Coefficients(
            self.linear + other.linear,
            self.attention + other.attention,
            self.elements + other.elements,
            self.overhead + other.overhead,
            self.per_module + other.per_module,
        )


@dataclass(frozen=True)
class ActionCosts:
    """Per-kind coefficients of the actions F, B (full backward), I and W (split backward).

    ``backward_input`` / ``backward_weight`` default to half of ``backward`` each (the
    hardware model's assumption; a calibration that measured split backwards fits them)."""

    forward: Coefficients
    backward: Coefficients
    backward_input: Coefficients | None = None
    backward_weight: Coefficients | None = None
    source: str = "hardware"  # where the constants come from, for the output
    #: the dtype the constants were measured or fitted in ("bf16" or "fp32"): the planner
    #: slows bf16 constants by :data:`FP32_SLOWDOWN` for a setting that runs in fp32; None:
    #: not stated, used as they are in every precision
    precision: str | None = None

    @classmethod
    def from_throughput(cls, flops_per_second: float) -> ActionCosts:
        """FLOPs at ``flops_per_second``, backward twice the forward, nothing else."""
        f = Coefficients(1 / flops_per_second, 1 / flops_per_second)
        return cls(f, f.scaled(2.0))

    def of(self, kind: rt.ComputationType) -> Coefficients:
        if kind == rt.FORWARD:
            return self.forward
        if kind == rt.FULL_BACKWARD:
            return self.backward
        split = self.backward_input if kind == rt.BACKWARD_INPUT else self.backward_weight
        return split if split is not None else self.backward.scaled(0.5)

    def scaled(self, factor: float) -> ActionCosts:
        """Every constant times ``factor`` (e.g. the fp32 slowdown)."""

        def sc(c: Coefficients | None) -> Coefficients | None:
            return None if c is None else c.scaled(factor)

        return ActionCosts(
            self.forward.scaled(factor),
            self.backward.scaled(factor),
            sc(self.backward_input),
            sc(self.backward_weight),
            self.source,
            self.precision,
        )


@dataclass(frozen=True)
class SelectiveAC:
    """What torchtitan's op-level selective activation checkpointing leaves a block with, per
    token on one rank (``SelectiveAC`` in torchtitan/distributed/activation_checkpoint.py,
    0.2.2 and 0.3.0 alike).

    Its policy saves the outputs of compute-intensive ops (matmuls, flash attention) and of
    reduce-scatters, except every second matmul of a block, which its backward recomputes with
    everything not saved (norms, RoPE, SiLU, products). torchtitan's Llama block runs its
    matmuls in the order ``wq wk wv wo w1 w3 w2`` (``w1 w2`` without a gated FFN), so it saves
    ``wq wv w1 w2`` and recomputes ``wk wo w3``; torchtitan 0.3's fuses the first three
    (``fuse_qkv``: ``wqkv wo w1 w3 w2``), so it saves ``wqkv w1 w2`` and recomputes ``wo w3``.
    Under tensor parallelism (sequence parallel) a column-parallel matmul's output is split
    ``t`` ways, a row-parallel one's is the whole sequence's partial sum, and the all-gathers
    a recomputed matmul reads run again."""

    saved_bytes: float  # per token: the block's input, the saved ops' outputs
    recompute_flops: float  # per token, at the model's full width (not divided by tp)
    regathers: int  # all-gathers a backward runs again (tensor parallelism only)


def selective_ac_layer(
    shape: ModelShape, tp: int, dtype_bytes: int, fused_qkv: bool = False
) -> SelectiveAC:
    """:class:`SelectiveAC` of one Llama block of ``shape`` at tensor-parallel degree ``tp``
    (``fused_qkv``: one ``wqkv`` matmul, torchtitan 0.3's Llama)."""
    s, b, t = shape, dtype_bytes, tp
    assert s.head_dim is not None and s.ffn_hidden is not None
    q, kv, h, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.hidden, s.ffn_hidden
    # (input width, output width, row-parallel, all-gather group): torchtitan's call order
    if fused_qkv:
        qkv = [(h, q + 2 * kv, False, 0)]
    else:
        qkv = [(h, q, False, 0), (h, kv, False, 0), (h, kv, False, 0)]
    mms = [*qkv, (q, h, True, None)]
    mms += [(h, f, False, 1)] + ([(h, f, False, 1)] if s.gated_ffn else []) + [(f, h, True, None)]
    saved = b * h / t + (b * q + 4 * s.n_heads) / t  # block input; attention output, its lse
    if t > 1:
        saved += 2 * b * h / t  # the two reduce-scatters' outputs
    flops, gathers = 0.0, set()
    for i, (n_in, n_out, row, group) in enumerate(mms, start=1):
        if i % 2:  # saved
            saved += b * n_out if row and t > 1 else b * n_out / t
        else:
            flops += 2 * n_in * n_out
            if t > 1 and group is not None:
                gathers.add(group)
    return SelectiveAC(saved, flops, len(gathers))


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per token and per parameter of one stage; formulas in the module docstring."""

    shape: ModelShape
    tp: int = 1
    fsdp: int = 1
    recompute: bool = False
    dtype_bytes: int = 2
    state_bytes_per_param: float = 16.0
    pipelined: bool = False  # pp > 1: FSDP keeps the stage unsharded for the whole step
    fsdp_wrapped: bool = False  # FSDP wraps the model at degree 1 too (torchtitan 0.3)
    # head + loss in chunks of this many tokens with their backward inside (ChunkedLoss, what
    # torchtitan 0.3's ChunkedLossWrapper becomes): the last stage keeps the hidden states'
    # fp32 gradient per token instead of fp32 log-probabilities over the vocabulary
    loss_chunk_tokens: int | None = None
    #: bytes per token per layer a trainer saves beyond the formula above (before the TP
    #: split), e.g. the 1-byte masks of two dropouts (``2*H``, Korthikanti et al. 2022, eq. 1)
    #: or RoPE's saved cos/sin factors (Megatron-LM: benchmarks.planner_models.published)
    extra_layer_bytes: float = 0.0
    #: torchtitan's op-level selective activation checkpointing (:func:`selective_ac_layer`);
    #: exclusive with ``recompute`` (full)
    selective: bool = False
    fused_qkv: bool = False  # one wqkv matmul (torchtitan 0.3's Llama): what selective AC keeps
    latent_kv: bool = False  # the latent K/V cache (``shape.latent_kv``; kv_cache = "latent")
    #: what the trainer's kernels and tensor-parallel plan save where trainers differ (norms,
    #: gathered matmul inputs, copies, RoPE factors, the backward's temporaries):
    #: :mod:`seq1f1b.planning.saved`; the default is the formula above
    saved: SavedTensors = FUSED

    def _full_layer_bytes(self, extra: bool = True) -> float:
        """Bytes a layer saves per token on one TP rank without checkpointing: the formula
        of the module docstring with the norms, matmul inputs, copies and RoPE factors of
        :attr:`saved`; ``extra``: with :attr:`extra_layer_bytes`."""
        s, b, p = self.shape, self.dtype_bytes, self.saved
        d, h = s.head_dim, s.hidden
        ffn = (p.ffn_saved_intermediates if s.gated_ffn else 2) * s.ffn_hidden
        # sharded over the TP ranks: norms, Q, K, V, attention output, its LSE, the FFN
        shard = 2 * p.norm_bytes(h, b) + b * (2 * s.n_heads * d + 2 * s.n_kv_heads * d + ffn)
        shard += 4 * s.n_heads + (b * s.n_heads * d if p.attention_output_copy else 0)
        whole = p.rope_bytes_per_head_dim * d  # RoPE's factors: the whole sequence's positions
        if p.gathered_matmul_inputs:  # the norms' outputs, all-gathered: the whole sequence
            whole += 2 * b * h
        else:
            shard += 2 * b * h
        return (shard + (self.extra_layer_bytes if extra else 0.0)) / self.tp + whole

    def layer_bytes_per_token(self, segmented: bool, cached: bool = True) -> float:
        """Bytes a layer keeps per token of a unit in flight (``segmented``: K > 1); with the
        latent K/V cache (``latent_kv``) the later segments' K/V is the latent. ``cached``:
        later segments read this unit's K/V (False: a sample's last segment, whose K/V a
        cache that holds what later segments read does not keep)."""
        s, b = self.shape, self.dtype_bytes
        # the K/V cache: softmax layers only (a hybrid's others carry a state, unit_bytes)
        kv = 2 * b * s.n_kv_heads * s.head_dim * s.softmax_layers / s.n_layers if segmented else 0
        if not cached:
            kv = 0
        if segmented and self.latent_kv and s.latent_kv is not None:
            kv = b * s.latent_kv.cached if cached else 0
            if not (self.recompute or self.selective):  # the expanded K/V are saved anyway
                return self._full_layer_bytes() + kv / self.tp
        if self.selective:  # later segments' K/V kept apart, as under full AC
            return self._selective_saved() + kv / self.tp
        if not self.recompute:
            return self._full_layer_bytes()
        return (b * s.hidden + kv) / self.tp

    def _selective_saved(self) -> float:
        """What selective AC keeps of a layer per token (:func:`selective_ac_layer`), less
        the attention's output and log-sum-exp where the policy does not keep the attention
        kernel's (:attr:`~seq1f1b.planning.saved.SavedTensors.sac_saves_attention`)."""
        s, b = self.shape, self.dtype_bytes
        saved = selective_ac_layer(s, self.tp, b, self.fused_qkv).saved_bytes
        if not self.saved.sac_saves_attention:
            saved -= (b * s.n_heads * s.head_dim + 4 * s.n_heads) / self.tp
        return saved

    def unit_bytes(
        self,
        tokens: float,
        layers: int,
        last: bool,
        segmented: bool,
        *,
        first: bool = False,
        cached: bool = True,
    ) -> float:
        """Bytes a forward of ``tokens`` leaves on a stage of ``layers`` blocks until its
        backward: the blocks' saved tensors, a hybrid's carried states (whatever ``tokens``),
        on the last stage the loss's fp32 log-probabilities, and where the trainer keeps them
        the unit's received input (not on the ``first`` stage) and output (not on the last).
        ``cached``: later segments read the unit's K/V (:meth:`layer_bytes_per_token`)."""
        saved = tokens * layers * self.layer_bytes_per_token(segmented, cached)
        if self.saved.keeps_stage_io:
            boundary = int(not first) + int(not last)
            saved += tokens * boundary * self.dtype_bytes * self.shape.hidden / self.tp
        saved -= self._window_kv_saving(tokens, layers, segmented)
        la = self.shape.linear_attention
        if segmented and la is not None:  # the state each Gated DeltaNet layer hands on
            share = layers * la.layers / self.shape.n_layers
            saved += share * la.state_bytes(self.dtype_bytes) / self.tp
        if last and self.loss_chunk_tokens is not None:
            saved += tokens * 4 * self.shape.hidden
        elif last:
            saved += tokens * 4 * self.shape.vocab / self.tp
        return saved

    def _window_kv_saving(self, tokens: float, layers: int, segmented: bool) -> float:
        """What sliding-window layers do not cache of a unit: later segments see only its last
        ``window - 1`` keys (and the ``sinks`` first ones), so where the cache is kept apart
        from the activations (full or selective AC) those layers hold that many positions of
        K/V, not ``tokens``. The windowed layers are ``window_layers / n_layers`` of the
        stage's on average."""
        s = self.shape
        if not segmented or s.window is None or not (self.recompute or self.selective):
            return 0.0
        kv = (s.latent_kv.cached if self.latent_kv and s.latent_kv is not None
              else 2 * s.n_kv_heads * s.head_dim) * self.dtype_bytes / self.tp  # fmt: skip
        windowed = layers * (s.window_layers or s.n_layers) / s.n_layers
        return windowed * max(0.0, tokens - (s.window - 1 + s.sinks)) * kv

    def backward_bytes(self, unit_tokens: float) -> float:
        """The gradients in flight at the peak of one layer's backward, per unit (where the
        trainer's profile prices them, :attr:`~seq1f1b.planning.saved.SavedTensors.
        backward_temporaries`; else 0). Measured on the dry run's block, its largest point is
        the FFN's start: the gradients of the product, of ``silu(gate)`` and of ``up``
        (``F`` wide each, split ``t`` ways) are alive while the product the output projection
        saved is freed, ``2*b*F/t`` (a two-matrix FFN: the activation's input gradient alone,
        ``b*F/t``); under sequence parallelism also the output gradient all-gathered for the
        row-parallel ``w2``, the whole sequence (``b*H``)."""
        if not self.saved.backward_temporaries:
            return 0.0
        s, b, t = self.shape, self.dtype_bytes, self.tp
        ffn = (2 if s.gated_ffn else 1) * b * s.ffn_hidden / t
        return unit_tokens * (ffn + (b * s.hidden if t > 1 else 0.0))

    def transient_bytes(self, unit_tokens: float, last: bool, first: bool = False) -> float:
        """Bytes alive only while one unit runs: a recomputed layer (with the backward's
        gradients in flight, :meth:`backward_bytes`), or the logits (and their fp32 copy) on
        the last stage, whichever is larger. Under selective AC a layer recomputes what the
        policy did not keep (where the profile prices the backward; the formula, all of it).
        Where the profile prices the backward, on the ``first`` stage also the embedding's
        weight gradient as its backward makes it, before adding it into the held one (the
        whole table: replicated under TP, :attr:`~seq1f1b.planning.saved.SavedTensors.
        replicated_embedding_grad`)."""
        recomputes = self.recompute or self.selective  # one layer's recomputed tensors
        transient = unit_tokens * self._full_layer_bytes(extra=False) if recomputes else 0.0
        if self.saved.backward_temporaries:
            if self.selective:
                transient -= unit_tokens * self._selective_saved()
            transient += self.backward_bytes(unit_tokens)
            if first:
                table = self.shape.vocab * self.shape.hidden * self.dtype_bytes
                whole = self.tp == 1 or self.saved.replicated_embedding_grad
                transient = max(transient, table if whole else table / self.tp)
        if last:
            upcast = 4 if self.dtype_bytes < 4 else 0  # the loss's fp32 copy of the logits
            logits = (self.dtype_bytes + upcast) * self.shape.vocab / self.tp
            chunk = unit_tokens
            if self.loss_chunk_tokens is not None:  # one chunk's logits, their gradient too
                chunk = 2 * min(unit_tokens, self.loss_chunk_tokens)
            transient = max(transient, chunk * logits)
        return transient

    def activation_bytes(
        self, tokens_in_flight: float, unit_tokens: float, layers: int, last: bool, segmented: bool
    ) -> float:
        """Peak activation bytes of a stage with ``layers`` blocks."""
        saved = self.unit_bytes(tokens_in_flight, layers, last, segmented)
        return saved + self.transient_bytes(unit_tokens, last)

    def state_bytes(self, layers: int, first: bool, last: bool) -> float:
        """Model-state bytes of a stage (sharded by TP and FSDP) plus what FSDP holds unsharded:
        two layers at a time without a pipeline, the whole stage with one (module docstring)."""
        s = self.shape
        params = layers * s.params_per_layer + s.vocab * s.hidden * (int(first) + int(last))
        sharded = params * self.state_bytes_per_param / (self.tp * self.fsdp)
        if first and self.tp > 1 and self.saved.replicated_embedding_grad:
            # the embedding's gradient, the whole vocabulary on every TP rank
            sharded += s.vocab * s.hidden * self.dtype_bytes * (1 - 1 / self.tp)
        if self.fsdp == 1 and not self.fsdp_wrapped:
            return sharded
        if self.pipelined:
            return sharded + params * (self.dtype_bytes + 4) / self.tp
        return sharded + 2 * 2 * self.dtype_bytes * s.params_per_layer / self.tp


@dataclass(frozen=True)
class TimeModel:
    """Seconds of one action on one GPU: its work priced by :class:`ActionCosts` (from the
    hardware figures, or calibrated) plus the TP collectives and the CP ring."""

    hardware: Hardware
    shape: ModelShape
    tp: int
    recompute: bool
    layers_per_stage: int
    dtype_bytes: int = 2
    bf16: bool = True  # False: the matmuls run at ``hardware.fp32_throughput``
    actions: ActionCosts | None = None  # calibrated constants (per GPU, this precision)
    cp: int = 1
    p2p_gbps: float | None = None  # pipeline send/receive bandwidth; None: not priced
    selective: bool = False  # torchtitan's op-level selective AC (exclusive with recompute)
    fused_qkv: bool = False  # one wqkv matmul (torchtitan 0.3's Llama): what selective AC keeps
    latent_kv: bool = False  # the latent K/V cache: its re-expansion priced (:func:`action_work`)

    @property
    def _flops_per_second(self) -> float:
        tflops = self.hardware.tflops if self.bf16 else self.hardware.fp32_throughput
        return self.tp * tflops * 1e12

    @property
    def costs(self) -> ActionCosts:
        """Per-GPU constants: the calibrated ones, or FLOPs at the hardware's throughput."""
        if self.actions is not None:
            return self.actions
        return ActionCosts.from_throughput(self._flops_per_second / self.tp)

    def _tp_seconds_per_token_pass(self, layers: int | None = None) -> float:
        """TP collectives of one pass (a forward, a backward or a recompute) per token."""
        if self.tp == 1:
            return 0.0
        moved = 4 * self.dtype_bytes * self.shape.hidden * (self.tp - 1) / self.tp
        n = self.layers_per_stage if layers is None else layers
        return n * moved / (self.hardware.tp_gbps * GB)

    def cp_forward_bytes(self, tokens: int, prefix: int, layers: int) -> float:
        """Bytes one rank sends around the CP ring in a forward of a segment of ``tokens``
        after ``prefix`` cached tokens (module docstring)."""
        if self.cp == 1:
            return 0.0
        s, b, hops = self.shape, self.dtype_bytes, self.cp - 1
        assert s.head_dim is not None
        local = tokens / self.cp
        own = 2 * local * s.n_kv_heads * s.head_dim * b
        by_q = 2 * local * s.n_heads * s.head_dim * b
        by_kv = 2 * (prefix / self.cp) * s.n_kv_heads * s.head_dim * b
        return layers * hops * (own + (min(by_q, by_kv) if prefix else 0.0))

    def seconds(
        self, kind: rt.ComputationType, work: Work, tokens: int, layers: int, prefix: int = 0
    ) -> float:
        """One action of a segment of ``tokens`` after ``prefix`` tokens whose full-width
        forward work is ``work`` on ``layers`` blocks: this GPU's share (``1/(tp*cp)``),
        collectives, and with recomputation the forward again in B or I."""
        local = work.scaled(1.0 / (self.tp * self.cp))
        costs = self.costs
        comm = tokens * self._tp_seconds_per_token_pass(layers)
        ring = self.cp_forward_bytes(tokens, prefix, layers) / (self.hardware.cp_bandwidth * GB)
        out = costs.of(kind).seconds(local)
        if kind == rt.FORWARD:
            return out + comm + ring
        if kind == rt.BACKWARD_WEIGHT:
            return out
        out += comm + 2 * ring
        if self.recompute:
            out += costs.forward.seconds(local) + comm + ring
        elif self.selective:
            out += self._selective_recompute_seconds(work, tokens, layers)
        return out

    def _selective_recompute_seconds(self, work: Work, tokens: int, layers: int) -> float:
        """What a backward under selective AC adds: the matmuls the policy did not save, the
        blocks' elementwise work and the all-gathers those matmuls read, on this GPU's share
        (no attention: flash attention's output is saved)."""
        sac = selective_ac_layer(self.shape, self.tp, self.dtype_bytes, self.fused_qkv)
        f = self.costs.forward
        share = 1.0 / (self.tp * self.cp)
        last = work.modules > layers  # the output layer and loss are not checkpointed
        blocks = work.elements - (tokens * self.shape.vocab if last else 0)
        compute = f.linear * tokens * layers * sac.recompute_flops * share
        compute += f.elements * blocks * share
        per_gather = self._tp_seconds_per_token_pass(layers) / 4  # one of a layer's four
        return compute + tokens * sac.regathers * per_gather

    def tp_comm_share(self, flops: float, tokens: int) -> float:
        """Share of a forward of the whole model (``flops``, all layers) spent in TP
        collectives (the rest is compute)."""
        compute = flops / self._flops_per_second
        comm = tokens * self._tp_seconds_per_token_pass(self.shape.n_layers)
        return comm / (compute + comm) if compute + comm > 0 else 0.0

    def p2p_seconds(self, tokens: int) -> float:
        """One pipeline send of a segment of ``tokens``: ``b*H`` bytes per token, split over
        the TP (sequence parallel) and CP ranks."""
        if self.p2p_gbps is None:
            return 0.0
        sent = tokens * self.dtype_bytes * self.shape.hidden / (self.tp * self.cp)
        return sent / (self.p2p_gbps * GB)

    def cost(
        self,
        lengths: Sequence[int],
        model_stages: int,
        *,
        seq_chunks: int | None = None,
        sends: bool = True,
    ) -> Callable[[Action], float]:
        """A :func:`seq1f1b.planning.simulate.simulate` cost callback in seconds: unit ``u`` is
        segment ``u % K`` of ``lengths``, stage ``g`` is chunk ``g % model_stages`` of the model
        (equal layers; the last chunk adds the output layer and the loss). A forward not on the
        last chunk and a backward not on the first also send their result to the next stage
        (``sends``; False: the send is priced apart, :meth:`p2p_seconds`)."""
        k = seq_chunks or len(lengths)
        layers = self.shape.n_layers // model_stages
        table: dict[tuple[bool, bool, int, rt.ComputationType], float] = {}
        end = 0
        for seg, n in enumerate(lengths):
            end += n
            send = self.p2p_seconds(n) if model_stages > 1 and sends else 0.0
            for first, last in itertools.product((False, True), repeat=2):
                work = action_work(self.shape, layers, last, n, end, self.latent_kv)
                for kind in (rt.FORWARD, rt.FULL_BACKWARD, rt.BACKWARD_INPUT, rt.BACKWARD_WEIGHT):
                    t = self.seconds(kind, work, n, layers, end - n)
                    sends = (kind == rt.FORWARD and not last) or (
                        kind in (rt.FULL_BACKWARD, rt.BACKWARD_INPUT) and not first
                    )
                    table[(first, last, seg, kind)] = t + (send if sends else 0.0)

        def seconds(a: Action) -> float:
            pos = a.stage_index % model_stages
            key = (pos == 0, pos == model_stages - 1, (a.microbatch_index or 0) % k)
            return table[(*key, a.computation_type)]

        return seconds


def fsdp_exposed_seconds(
    params: float,
    fsdp: int,
    gbps: float | None,
    layers: int,
    *,
    pipelined: bool,
    microbatches: int,
    forward: float,
    backward: float,
) -> float:
    """Seconds of FSDP communication a rank's compute cannot hide, per step.

    ``params``: the rank's parameters (after TP); ``forward`` / ``backward``: seconds of one
    forward / backward of a unit on its stage(s). FSDP moves bf16 weights in its all-gathers and
    fp32 gradients in its reduce-scatters (torchtitan's mixed-precision policy), ``(f-1)/f`` of
    them per rank, one layer ahead of the compute (prefetch), so each layer's traffic hides
    behind the compute it overlaps and only the first layer's gather and the last layer's
    reduction are exposed:

    * under a pipeline the stage stays gathered for the whole step: one all-gather before the
      first forward, one reduce-scatter after the last backward, each overlapping that action;
    * without one, every microbatch gathers each layer for its forward and again for its
      backward, and reduce-scatters it after the backward.
    """
    if fsdp <= 1 or gbps is None or params <= 0:
        return 0.0
    share = (fsdp - 1) / fsdp / (gbps * GB)
    gather, reduce = 2 * params * share, 4 * params * share
    if pipelined:
        first = gather / layers + max(0.0, gather - forward)
        last = reduce / layers + max(0.0, reduce - backward)
        return first + last
    per_layer = max(0.0, (gather - forward) / layers) + max(
        0.0, (gather + reduce - backward) / layers
    )
    return microbatches * (layers * per_layer + (gather + reduce) / layers)
