"""Memory and time of one pipeline stage, per GPU, for the planner.

Why a separate module: the planner searches settings, this module prices one of them, and the
formulas are the part users argue with, so they are stated here in one place.

Precision: a setting computes either in bf16 (``b = 2``; fp32 master weights, gradients and
Adam moments) or in fp32 (``b = 4``), whichever its trainer will really run; the planner
decides which (:func:`seq1f1b.planner.runs_in_bf16`), this module prices both.

Memory (bytes per GPU; ``b`` = activation dtype bytes, ``t`` = tensor-parallel degree with
sequence parallelism, so every activation and weight is split ``t`` ways):

* saved activations per token per layer, Llama block (RMSNorm, RoPE, SwiGLU, no dropout, flash
  attention so no score matrix)::

      b * (2H  norm inputs  + 2H  norm outputs  + h*d  Q  + 2*h_kv*d  K, V  + h*d  attention out
           + 4F  gate, up, silu(gate), silu*up)  +  4*h  fp32 log-sum-exp

  (``2F`` instead of ``4F`` for a plain two-matrix FFN); divided by ``t``;
* full activation checkpointing (torchtitan ``mode = "full"``): only each layer's input, ``b*H``
  per token per layer, plus, with ``K > 1`` segments, the K/V of earlier segments that later
  segments read (``2*b*h_kv*d``); the backward of one unit recomputes one layer's activations
  of that unit on top (a transient);
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
* a stage's activation peak = peak tokens in flight on the stage (from the simulated schedule)
  times the per-token bytes.

Time (seconds): a unit's FLOPs (:func:`seq1f1b.partition.segment_flops`, causal attention
included) over ``t * flops_per_gpu`` (``Hardware.tflops`` in bf16,
``Hardware.fp32_throughput`` in fp32); backward = 2 forwards, 3 with full recomputation; plus
the tensor-parallel collectives, not overlapped: 4 per layer per pass (2 all-gathers, 2
reduce-scatters of ``b*H`` per token) each moving ``(t-1)/t`` of its bytes at ``tp_bandwidth``.
FSDP's all-gathers / reduce-scatters are assumed overlapped with compute, pipeline p2p is
ignored (a few MB per unit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._runtime import ir as rt
from ._runtime.ir import Action
from .partition import ModelShape
from .simulate import FlopsCosts

__all__ = ["FP32_SLOWDOWN", "PRESETS", "Hardware", "MemoryModel", "TimeModel"]

GB = 1e9
#: dense bf16 over fp32 peak: H100 SXM 989 / 67, A100 312 / 19.5. torch keeps TF32 off for
#: matmuls by default and torchtitan does not turn it on, so fp32 runs on the fp32 units.
FP32_SLOWDOWN = 15.0

#: Model shapes by name. Llama 3: Meta's published configs (torchtitan's ``llama3_args``);
#: ``paper-7b``: the Seq1F1B paper's 7B (GPT-style FFN of 4H, vocabulary 50304, no GQA).
PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(4096, 32, 32, 128256, ffn_hidden=14336, n_kv_heads=8, gated_ffn=True),
    "llama3-70b": ModelShape(8192, 64, 80, 128256, ffn_hidden=28672, n_kv_heads=8, gated_ffn=True),
    "paper-7b": ModelShape(4096, 32, 32, 50304),
}


@dataclass(frozen=True)
class Hardware:
    """What one GPU offers; defaults are an H100 SXM at a typical 40% of its bf16 peak."""

    gpus: int
    memory_gb: float
    reserve_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    tflops: float = 400.0  # achieved dense bf16 TFLOP/s per GPU
    tp_gbps: float = 300.0  # achieved all-gather / reduce-scatter bandwidth inside a node
    #: achieved fp32 TFLOP/s for settings that run in fp32; None: ``tflops / FP32_SLOWDOWN``
    fp32_tflops: float | None = None

    @property
    def budget_bytes(self) -> float:
        return (self.memory_gb - self.reserve_gb) * GB

    @property
    def fp32_throughput(self) -> float:
        """Achieved fp32 TFLOP/s: given, or the bf16 figure scaled by the hardware ratio."""
        return self.fp32_tflops if self.fp32_tflops is not None else self.tflops / FP32_SLOWDOWN


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

    def _full_layer_bytes(self) -> float:
        s, b = self.shape, self.dtype_bytes
        d = s.head_dim
        ffn = (4 if s.gated_ffn else 2) * s.ffn_hidden
        return b * (4 * s.hidden + 2 * s.n_heads * d + 2 * s.n_kv_heads * d + ffn) + 4 * s.n_heads

    def layer_bytes_per_token(self, segmented: bool) -> float:
        """Bytes a layer keeps per token of a unit in flight (``segmented``: K > 1)."""
        if not self.recompute:
            return self._full_layer_bytes() / self.tp
        s, b = self.shape, self.dtype_bytes
        kv = 2 * b * s.n_kv_heads * s.head_dim if segmented else 0
        return (b * s.hidden + kv) / self.tp

    def activation_bytes(
        self, tokens_in_flight: float, unit_tokens: int, layers: int, last: bool, segmented: bool
    ) -> float:
        """Peak activation bytes of a stage with ``layers`` blocks."""
        saved = tokens_in_flight * layers * self.layer_bytes_per_token(segmented)
        transient = unit_tokens * self._full_layer_bytes() / self.tp if self.recompute else 0.0
        if last:
            saved += tokens_in_flight * 4 * self.shape.vocab / self.tp
            upcast = 4 if self.dtype_bytes < 4 else 0  # the loss's fp32 copy of the logits
            logits = (self.dtype_bytes + upcast) * self.shape.vocab / self.tp
            transient = max(transient, unit_tokens * logits)
        return saved + transient

    def state_bytes(self, layers: int, first: bool, last: bool) -> float:
        """Model-state bytes of a stage (sharded by TP and FSDP) plus what FSDP holds unsharded:
        two layers at a time without a pipeline, the whole stage with one (module docstring)."""
        s = self.shape
        params = layers * s.params_per_layer + s.vocab * s.hidden * (int(first) + int(last))
        sharded = params * self.state_bytes_per_param / (self.tp * self.fsdp)
        if self.fsdp == 1 and not self.fsdp_wrapped:
            return sharded
        if self.pipelined:
            return sharded + params * (self.dtype_bytes + 4) / self.tp
        return sharded + 2 * 2 * self.dtype_bytes * s.params_per_layer / self.tp


@dataclass(frozen=True)
class TimeModel:
    """Seconds of one unit's actions on one GPU: FLOPs over throughput plus TP collectives."""

    hardware: Hardware
    shape: ModelShape
    tp: int
    recompute: bool
    layers_per_stage: int
    dtype_bytes: int = 2
    bf16: bool = True  # False: the matmuls run at ``hardware.fp32_throughput``

    @property
    def _flops_per_second(self) -> float:
        tflops = self.hardware.tflops if self.bf16 else self.hardware.fp32_throughput
        return self.tp * tflops * 1e12

    def _tp_seconds_per_token_pass(self) -> float:
        """TP collectives of one pass (a forward, a backward or a recompute) per token."""
        if self.tp == 1:
            return 0.0
        moved = 4 * self.dtype_bytes * self.shape.hidden * (self.tp - 1) / self.tp
        return self.layers_per_stage * moved / (self.hardware.tp_gbps * GB)

    def tp_comm_share(self, flops: float, tokens: int) -> float:
        """Share of a forward spent in TP collectives (the rest is compute)."""
        compute = flops / self._flops_per_second
        comm = tokens * self._tp_seconds_per_token_pass()
        return comm / (compute + comm) if compute + comm > 0 else 0.0

    def forward_backward(self, flops: float, tokens: int) -> tuple[float, float]:
        """(forward, full backward) seconds of a unit of ``tokens`` and ``flops`` forward FLOPs
        on this stage (whole model width: divided by ``tp`` here)."""
        compute = flops / self._flops_per_second
        comm = tokens * self._tp_seconds_per_token_pass()
        if self.recompute:
            return compute + comm, 3 * compute + 2 * comm
        return compute + comm, 2 * compute + comm

    def cost(self, costs: FlopsCosts) -> Callable[[Action], float]:
        """A :func:`seq1f1b.simulate.simulate` cost callback in seconds for ``costs``' units."""
        k = len(costs.lengths)
        per_unit = [
            self.forward_backward(f, n)
            for f, n in zip(costs.segment_costs, costs.lengths, strict=True)
        ]

        def seconds(a: Action) -> float:
            fwd, bwd = per_unit[(a.microbatch_index or 0) % k]
            if a.computation_type == rt.FORWARD:
                return fwd
            return bwd if a.computation_type == rt.FULL_BACKWARD else bwd / 2

        return seconds
