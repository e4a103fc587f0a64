"""What a trainer's blocks save for their backward where trainers differ: the planner's
named saved-tensor profiles (:class:`SavedTensors`), which
:class:`~seq1f1b.planning.costmodel.MemoryModel` prices per token and layer.

Why profiles and not one formula: the same Llama block saves different tensors under
different kernels and tensor-parallel plans, measured (``python -m
benchmarks.dry_run.planner_check``, and the saved tensors of one block listed by autograd):

* RMSNorm: torch's CUDA kernel (``_fused_rms_norm``, what ``F.rms_norm`` runs on a GPU from
  torch 2.8), inductor's fused norm and Megatron-LM's fused norm keep the bf16 input and an
  fp32 reciprocal RMS per token; torch's composite ``rms_norm`` (what ``F.rms_norm`` runs on
  the CPU, so what the dry run sees) keeps the input's fp32 upcast and the fp32 normalized
  product, 8 bytes an element;
* the column-parallel matmuls after a sequence-parallel norm: torch's ``ColwiseParallel``
  after ``SequenceParallel`` (torchtitan's plan) saves the all-gathered input, the whole
  sequence on every TP rank (``2*b*H`` per token-layer, not divided by ``t``); Megatron-LM
  saves the shard and gathers it again in the backward (``2*b*H/t``);
* the output projection's input: torch's CPU flash-attention kernel returns ``(b, h, s, d)``
  contiguous, so the ``(b, s, h*d)`` input of ``wo`` is a copy (``b*H/t``); the CUDA flash
  kernels write ``(b, s, h, d)`` and the reshape is a view;
* RoPE: the direct API's model (:mod:`seq1f1b.testing`) multiplies by bf16 cos and sin
  tables, saved once per rotated tensor (Q and K: ``2*b*d`` per token-layer, the whole
  sequence under sequence parallelism); torchtitan's complex multiply saves nothing per token
  (its table is a buffer), nor does a fused RoPE kernel;
* the backward's temporaries at the peak (:attr:`SavedTensors.backward_temporaries`).

``FUSED`` is the formula the planner always priced (the default, the Megatron-LM pricing of
``benchmarks/planner_models/published.py`` adds its own items on top of it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FUSED",
    "PROFILES",
    "TORCH_COMPILED",
    "TORCH_EAGER_CPU",
    "TORCH_EAGER_CUDA",
    "SavedTensors",
]


@dataclass(frozen=True)
class SavedTensors:
    """What a block saves beyond the dtype-sized Q, K, V, attention output, log-sum-exp and
    FFN intermediates that every trainer saves, per token and layer.

    Args:
        name: how the profile is named.
        norm_bytes_per_element: bytes each of a block's two norms keeps per hidden element
            (its output apart): None for the activation dtype's (the bf16 input of a fused
            kernel), 8 for the composite's fp32 upcast input and fp32 normalized product.
        norm_rstd: each norm also keeps an fp32 reciprocal RMS per token (4 bytes).
        gathered_matmul_inputs: under sequence parallelism the column-parallel matmuls keep
            their all-gathered input (two per block, the whole sequence: not divided by ``t``)
            rather than the shard.
        attention_output_copy: the output projection's input is a copy of the attention's
            output in another layout (``b*H``, divided by ``t``).
        rope_bytes_per_head_dim: RoPE's saved factors, bytes per token-layer per head-dim
            element (the whole sequence under sequence parallelism): ``2*b`` for bf16 cos and
            sin tables kept for Q and for K, 0 where nothing per token is kept.
        ffn_saved_intermediates: of a gated FFN's four ``F``-wide tensors (gate, up,
            ``silu(gate)``, the product) how many are kept: 4 in eager, 3 compiled (inductor
            keeps gate, up and the product, and recomputes ``silu(gate)`` in the backward).
        sac_saves_attention: selective activation checkpointing keeps the attention's
            output and log-sum-exp (torchtitan's policy keeps torch's CUDA flash kernels' and
            the compiled chunk-aware attention's; torch's CPU flash kernel is not on its list,
            so on the CPU the attention is recomputed).
        backward_temporaries: price the gradients in flight inside one layer's backward at the
            rank's peak, and a recomputing backward's layer on top of them
            (:meth:`~seq1f1b.planning.costmodel.MemoryModel.backward_bytes`).
        keeps_stage_io: torch's pipeline stage keeps each unit's output (not on the last stage)
            and its received input (not on the first) until the unit's backward, ``b*H/t``
            per token each (Megatron-LM frees its outputs' data once sent).
        backward_sends_held: torch 2.15's runtime waits for a backward's send only at the
            step's end (``_add_wait_send``: "backward sends ... wait at schedule end"), so
            each unit's input gradient a non-first stage sends, ``b*H/t`` per token, is held
            from its backward to the end of the step (torch's schedules; the Seq1F1B
            family waits for each once the peer has it, ``backward_send_waits="consumed"``).
        kv_cache_by_reader: the K/V cache holds what later segments read only (not a sample's
            last segment's K/V), and the K/V gradients later segments leave on it are held
            from the sample's last segment's backward to each owning segment's backward (the
            library's chunk-aware attention).
        replicated_embedding_grad: under tensor parallelism the row-wise (vocabulary-sharded)
            embedding's gradient comes back replicated, the whole vocabulary on every TP rank
            (torch's DTensor sharding of its backward, torch 2.15): ``(1 - 1/t) * V*H`` more
            gradient bytes on the first stage.
    """

    name: str
    norm_bytes_per_element: float | None = None
    norm_rstd: bool = False
    gathered_matmul_inputs: bool = False
    attention_output_copy: bool = False
    rope_bytes_per_head_dim: float = 0.0
    ffn_saved_intermediates: int = 4
    sac_saves_attention: bool = True
    backward_temporaries: bool = False
    keeps_stage_io: bool = False
    backward_sends_held: bool = False
    kv_cache_by_reader: bool = False
    replicated_embedding_grad: bool = False

    def norm_bytes(self, hidden: int, dtype_bytes: int) -> float:
        """What one norm keeps per token (its output apart)."""
        per = dtype_bytes if self.norm_bytes_per_element is None else self.norm_bytes_per_element
        return per * hidden + (4.0 if self.norm_rstd else 0.0)


#: the formula the planner always priced: fused norms (their bf16 input), the norms' outputs
#: as shards, no copies, no RoPE factors, no backward temporaries (Megatron-LM's kernels, the
#: pricing of the paper's cells)
FUSED = SavedTensors("fused")
#: torch's eager ops on a GPU, with torchtitan's tensor-parallel plan: the CUDA RMSNorm kernel
#: (bf16 input, fp32 reciprocal RMS), the all-gathered matmul inputs, the backward's
#: temporaries; the RoPE factors of the direct API's model
_TORCH = {"norm_rstd": True, "gathered_matmul_inputs": True, "backward_temporaries": True,
          "keeps_stage_io": True, "backward_sends_held": True, "kv_cache_by_reader": True,
          "replicated_embedding_grad": True}  # fmt: skip
TORCH_EAGER_CUDA = SavedTensors("torch-eager-cuda", rope_bytes_per_head_dim=4.0, **_TORCH)
#: torch's eager ops on the CPU, what the dry run runs: the composite RMSNorm's two fp32
#: copies, the all-gathered matmul inputs, the attention output's copy for ``wo``, the RoPE
#: factors of the direct API's model, the backward's temporaries
TORCH_EAGER_CPU = SavedTensors(
    "torch-eager-cpu", norm_bytes_per_element=8.0, attention_output_copy=True,
    rope_bytes_per_head_dim=4.0, sac_saves_attention=False, **_TORCH,
)  # fmt: skip
#: torch.compile'd blocks (torchtitan's ``[compile]``), measured on the direct API's block
#: (CPU, inductor, TP 1): the norm fused (its bf16 input and reciprocal RMS kept), RoPE's
#: factors recomputed (the positions kept, 8 bytes a token), ``silu(gate)`` recomputed; the
#: attention output's copy for ``wo`` is the CPU kernel's layout (not priced here, as on a
#: GPU). The partitioner does not recompute collectives, so the all-gathered matmul inputs
#: stay (not measured: the compiled TP block was not run on the fake process group)
TORCH_COMPILED = SavedTensors("torch-compiled", ffn_saved_intermediates=3, **_TORCH)
#: the profiles by name
PROFILES = {p.name: p for p in (FUSED, TORCH_EAGER_CUDA, TORCH_EAGER_CPU, TORCH_COMPILED)}
