"""The Seq1F1B paper's published results, the planner's predictions of them, and the fit of a
GPU profile's efficiencies to a few of them.

Why: these are the only GPU measurements of these schedules available (REFERENCE.md section 1:
"Seq1F1B", arXiv 2406.03488, 7B on 32 A100s). A profile's efficiencies are fitted on a few
cells (:data:`FIT_CELLS`) and every other cell is predicted, so the comparison says how far the
planner can be trusted on cells it never saw.

The paper's setting, from its public fork (thunlp/Seq1F1B: ``run.sh``, ``exp.sh``,
``megatron/arguments.py``, ``megatron/training.py``) and the memory row: pp 4 x tp 8 with
sequence parallelism, 8 microbatches of one sequence, K = 4 (compute split), two stages per
rank for the interleaved schedules, no recomputation, bf16 with fp32 master weights and the
distributed optimizer at data-parallel degree 1, flash attention, RoPE, dropout 0, the GPT-2
vocabulary padded to 51200. Its P2P is Megatron's blocking batched send/receive
(``--overlap-p2p-communication`` is off by default there), so the paper's cells are simulated
with :func:`~seq1f1b.planning.simulate.simulate_blocking`. Its TFLOPS are the fork's own count
(:func:`paper_flops`: causal attention, both vocabulary matmuls); its memory is
``torch.cuda.max_memory_reserved()`` in GiB (2**30 bytes), per pipeline stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from seq1f1b.planning.costmodel import GB, PRESETS, Hardware, MemoryModel
from seq1f1b.planning.fitting import Observation, fit_efficiency
from seq1f1b.planning.planner import Candidate, Setting, price
from seq1f1b.planning.profiles import Efficiency, GpuProfile
from seq1f1b.schedules.partition import ModelShape

from .published_titan import PUBLISHED, allocator_slack

__all__ = [
    "FIT_CELLS",
    "PAPER_SHAPE",
    "PUBLISHED_MEMORY_64K",
    "PUBLISHED_TFLOPS",
    "SCHEDULES",
    "Cell",
    "cell_observations",
    "claim_30b_rows",
    "fit",
    "memory_rows",
    "memory_vs_published",
    "paper_candidate",
    "paper_flops",
    "tflops_rows",
]

GIB = 2.0**30

_PAPER = PUBLISHED["seq1f1b_paper_7b"]
#: TFLOPS per GPU, 7B on 32 A100s, 8 microbatches (published.json; REFERENCE.md section 1);
#: None: OOM
PUBLISHED_TFLOPS: dict[int, dict[str, float | None]] = {
    int(seq_len): row for seq_len, row in _PAPER["tflops_per_gpu"].items()
}
#: per GPU, 7B on 32 A100s, 64k tokens (published.json), in GiB: the fork logs
#: ``torch.cuda.max_memory_reserved() / 1024**3`` (``get_mem`` in megatron/training.py)
PUBLISHED_MEMORY_64K: dict[str, float] = dict(_PAPER["memory_gib_64k"])
#: paper name -> (registry schedule, stages per rank, K)
SCHEDULES = {
    "1F1B": ("1F1B", 1, 1),
    "1F1B-I": ("Interleaved1F1B", 2, 1),
    "Seq1F1B": ("Seq1F1B", 1, 4),
    "Seq1F1B-I": ("InterleavedSeq1F1B", 2, 4),
}
PAPER_PP, PAPER_TP, PAPER_M, PAPER_GPUS = 4, 8, 8, 32
#: the paper's 7B as its fork ran it: GPT-2's 50257 tokens padded by Megatron to a multiple of
#: ``make_vocab_size_divisible_by`` (128) times tp (8), i.e. 51200
PAPER_SHAPE = replace(PRESETS["paper-7b"], vocab=51200)
#: the 30B of the paper's "30B at 64k on 64 A100s" (exp.sh: 64 layers, hidden 6144, 64 heads,
#: FFN 4H; tp 8 x pp 8, 16 microbatches, K = 4)
PAPER_30B = ModelShape(6144, 64, 64, 51200)


@dataclass(frozen=True)
class Cell:
    """One published TFLOPS cell: absolute (``ratio_to`` None) or as a ratio to another
    schedule at the same length (1F1B, or Seq1F1B at 128k where 1F1B did not fit)."""

    seq_len: int
    schedule: str
    ratio_to: str | None = "1F1B"

    @property
    def label(self) -> str:
        base = f"{self.schedule} @{self.seq_len // 1024}k"
        return base + (f" / {self.ratio_to}" if self.ratio_to else " TFLOPS")

    def published(self) -> float:
        row = PUBLISHED_TFLOPS[self.seq_len]
        value = row[self.schedule]
        assert value is not None, f"{self.label}: published as OOM"
        if self.ratio_to is None:
            return value
        base = row[self.ratio_to]
        assert base is not None
        return value / base

    def predicted(self, tflops: Callable[[int, str], float]) -> float:
        value = tflops(self.seq_len, self.schedule)
        return value if self.ratio_to is None else value / tflops(self.seq_len, self.ratio_to)


#: the cells the A100 efficiencies are fitted on: 1F1B's absolute TFLOPS at 32k and 64k (the
#: kernels' efficiency, linear vs attention by the two lengths), and as ratios to 1F1B
#: Seq1F1B at 64k (the per-action overhead), Seq1F1B-I at 32k and 1F1B-I at 64k (the links);
#: every other cell is held out
FIT_CELLS = (
    Cell(32768, "1F1B", None),
    Cell(65536, "1F1B", None),
    Cell(65536, "Seq1F1B"),
    Cell(32768, "Seq1F1B-I"),
    Cell(65536, "1F1B-I"),
)


def _all_cells() -> list[Cell]:
    cells = []
    for seq_len, row in PUBLISHED_TFLOPS.items():
        base = "1F1B" if row["1F1B"] is not None else "Seq1F1B"
        for name, value in row.items():
            if value is None:
                continue
            cells.append(Cell(seq_len, name, None))
            if name != base:
                cells.append(Cell(seq_len, name, base))
    return cells


def paper_flops(seq_len: int, sequences: int, shape: ModelShape = PAPER_SHAPE) -> float:
    """FLOPs of a step of ``sequences`` as the paper's fork counts them for its TFLOPS
    (``SeqTFlops.get_seq_tflops(causal=True)`` in sp_utils.py, times 3 for forward and
    backward): per sequence, the embedding and output matmuls ``2*s*H*V`` each, and per layer
    ``8*s*H^2 + 4*s*H*F`` (projections, FFN) plus half of full attention's
    ``2*s^2*H + 3*s^2*h + 2*s^2*H`` (scores, softmax, weighted values)."""
    s, h, heads = seq_len, shape.hidden, shape.n_heads
    ffn = shape.ffn_hidden
    assert ffn is not None
    layer = 8 * s * h * h + 4 * s * h * ffn + 0.5 * (4 * s * s * h + 3 * s * s * heads)
    return 3.0 * sequences * (4 * s * h * shape.vocab + shape.n_layers * layer)


#: Megatron's model state per parameter with bf16: bf16 weights (2), fp32 main gradients (4;
#: Megatron-LM's arguments force ``accumulate_allreduce_grads_in_fp32`` with ``--bf16``), fp32
#: master weights (4) and Adam's two moments (8); torchtitan's FSDP keeps no bf16 copy (16)
MEGATRON_STATE_BYTES = 18.0


def megatron_layer_items(shape: ModelShape, tp: int, micro_batch: int = 1) -> dict[str, float]:
    """What Megatron-LM's GPT layer (the fork's megatron/model/transformer.py, flash
    attention, RoPE, sequence parallel) saves per token beyond the planner's formula, in bytes
    per layer before the TP split, by item:

    * ``attention output copy``: the output projection saves the ``[s, b, h]`` attention
      output, made by ``rearrange(context, 'b s h d -> s b (h d)').contiguous()`` from the
      tensor flash attention keeps; with one sequence per microbatch that permutation moves
      only a size-1 dimension, so ``.contiguous()`` returns the same tensor and there is no
      copy (0); with more, ``2*H`` bf16 bytes;
    * ``RoPE factors``: ``apply_rotary_pos_emb`` (megatron/core/models/common/
      rotary_pos_embedding.py) computes ``t * freqs.cos() + _rotate_half(t) * freqs.sin()``
      for the queries and for the keys, and each product saves its ``[s, 1, 1, d]`` factor,
      bf16 (``Float16Module`` casts the ``inv_freq`` buffer): four of ``2*d`` bytes per
      token, the same on every TP rank, hence times ``tp`` here;
    * ``dropout masks``: the two fused bias-dropout-adds keep a 1-byte mask per element of
      ``[s, b, h]`` (``2*H``) even at dropout 0: ``bias_dropout_add_fused_train`` is
      TorchScript, which Megatron runs with autodiff subgraphs kept
      (``_debug_set_autodiff_subgraph_inlining(False)``, megatron/initialize.py), and
      TorchScript differentiates dropout through ``aten::native_dropout``, whose boolean
      mask is an output of the forward graph kept for the backward (seen in the optimized
      graph on torch 2.15; ``native_dropout`` returns a full mask for any ``p``)."""
    return {
        "attention output copy": 2.0 * shape.hidden if micro_batch > 1 else 0.0,
        "RoPE factors": 4 * 2.0 * shape.head_dim * tp,
        "dropout masks": 2.0 * shape.hidden,
    }


def megatron_extra_layer_bytes(shape: ModelShape, tp: int, micro_batch: int = 1) -> float:
    """The sum of :func:`megatron_layer_items`."""
    return math.fsum(megatron_layer_items(shape, tp, micro_batch).values())


def megatron_candidate(
    prof: GpuProfile,
    shape: ModelShape,
    seq_len: int,
    name: str,
    *,
    pp: int,
    tp: int,
    microbatches: int,
    reserve_gb: float | None = None,
) -> Candidate:
    """The planner's price of schedule ``name`` (a key of :data:`SCHEDULES`) as Megatron-LM
    (the paper's fork) runs it on ``pp * tp`` of ``prof``'s GPUs, one sequence per microbatch:
    18 B of state per parameter, what its layer saves beyond the formula
    (:func:`megatron_layer_items`), the fork's K/V prefix copy, blocking P2P."""
    sched, v, k = SCHEDULES[name]
    setting = Setting(pp, tp, 1, k, microbatches, "compute", False, True, sched, v)
    hw = prof.hardware(pp * tp, reserve_gb)
    return price(
        setting, shape, seq_len, hw, actions=prof.action_costs(),
        state_bytes_per_param=MEGATRON_STATE_BYTES,
        extra_layer_bytes=megatron_extra_layer_bytes(shape, tp), blocking_p2p=True,
        kv_prefix_copy=True,
    )  # fmt: skip


def paper_candidate(
    prof: GpuProfile, seq_len: int, name: str, reserve_gb: float | None = None
) -> Candidate:
    """The planner's price of the paper's 7B setting of schedule ``name`` on ``prof``."""
    return megatron_candidate(
        prof, PAPER_SHAPE, seq_len, name,
        pp=PAPER_PP, tp=PAPER_TP, microbatches=PAPER_M, reserve_gb=reserve_gb,
    )  # fmt: skip


def sp_gather_bytes(cand: Candidate, shape: ModelShape) -> float:
    """Megatron's sequence-parallel all-gather buffer: the largest unit's ``[s, b, H]`` in bf16,
    allocated once through the caching allocator and kept (``get_global_memory_buffer()``,
    megatron/core/tensor_parallel/layers.py)."""
    return max(cand.segment_lengths) * shape.hidden * 2.0


def sp_backward_transient_bytes(cand: Candidate, shape: ModelShape, tp: int) -> float:
    """The largest a layer's backward holds at once beyond the saved tensors, under Megatron's
    sequence parallelism (``LinearWithGradAccumulationAndAsyncCommunication.backward``,
    megatron/core/tensor_parallel/layers.py), for the largest unit: at the FFN's first
    matmul, its input gradient over the whole sequence before the reduce-scatter (``2*H``
    bytes per token), the reduce-scattered copy (``2*H/t``) and the gradient it came from,
    the FFN's hidden activations (``2*F/t``); bf16. The weight gradients go straight into the
    fp32 ``main_grad`` (gradient-accumulation fusion, on in the fork's run.sh), no copy."""
    ffn = shape.ffn_hidden
    assert ffn is not None
    per_token = 2.0 * shape.hidden + (2.0 * shape.hidden + 2.0 * ffn) / tp
    return max(cand.segment_lengths) * per_token


def _tflops_of(prof: GpuProfile) -> Callable[[int, str], float]:
    cache: dict[tuple[int, str], float] = {}

    def tflops(seq_len: int, name: str) -> float:
        if (seq_len, name) not in cache:
            step = paper_candidate(prof, seq_len, name).step_seconds
            flops = paper_flops(seq_len, PAPER_M)
            cache[(seq_len, name)] = flops / (step * PAPER_GPUS) / 1e12
        return cache[(seq_len, name)]

    return tflops


def tflops_rows(prof: GpuProfile, fitted: Iterable[Cell] = FIT_CELLS) -> list[dict[str, Any]]:
    """Every published TFLOPS cell (absolute, and as a ratio to the length's baseline),
    predicted on ``prof``, with its error and whether it was fitted on."""
    tflops = _tflops_of(prof)
    fit_set = set(fitted)
    rows = []
    for cell in _all_cells():
        pred, pub = cell.predicted(tflops), cell.published()
        rows.append(
            {
                "cell": cell.label,
                "seq_len": cell.seq_len,
                "schedule": cell.schedule,
                "ratio_to": cell.ratio_to,
                "published": pub,
                "predicted": pred,
                "error": pred / pub - 1,
                "fitted": cell in fit_set,
            }
        )
    return rows


def fits_rows(prof: GpuProfile) -> list[dict[str, Any]]:
    """Every (length, schedule) of the table: published to run or OOM, predicted to fit or not
    (the profile's memory and reserve)."""
    rows = []
    for seq_len, row in PUBLISHED_TFLOPS.items():
        for name, value in row.items():
            cand = paper_candidate(prof, seq_len, name)
            rows.append(
                {
                    "seq_len": seq_len,
                    "schedule": name,
                    "published_runs": value is not None,
                    "predicted_fits": cand.fits,
                    "predicted_gb": cand.max_bytes / GB,
                    "budget_gb": cand.budget_bytes / GB,
                }
            )
    return rows


def _paper_peak_gib(prof: GpuProfile, name: str, extra: float, kv_copy: bool) -> float:
    sched, v, k = SCHEDULES[name]
    setting = Setting(PAPER_PP, PAPER_TP, 1, k, PAPER_M, "compute", False, True, sched, v)
    cand = price(
        setting, PAPER_SHAPE, 65536, prof.hardware(PAPER_GPUS, 0.0),
        actions=prof.action_costs(), state_bytes_per_param=MEGATRON_STATE_BYTES,
        extra_layer_bytes=extra, blocking_p2p=True, kv_prefix_copy=kv_copy,
    )  # fmt: skip
    return cand.max_bytes / GIB


def memory_rows(prof: GpuProfile) -> list[dict[str, Any]]:
    """The published 64k memory row (GiB, what the caching allocator reserved) against the
    planner's items, each from the fork's code: the worst rank's peak of model state (18 B
    per parameter) and activations along the schedule's order, then what each of
    :func:`megatron_layer_items` and the fork's K/V prefix copy
    (:func:`~seq1f1b.planning.planner.kv_prefix_deltas`) adds to that peak, in turn
    (``items``), plus the sequence-parallel gather buffer and the backward's transient
    (:func:`sp_backward_transient_bytes`); and the caching allocator's slack, the fraction of
    the activations read from torchtitan's published H100 cell
    (:func:`~benchmarks.planner_models.published_titan.allocator_slack`), nothing fitted
    here. What is left is not attributed."""
    rows = []
    layer_items = megatron_layer_items(PAPER_SHAPE, PAPER_TP)
    slack = allocator_slack()
    state_model = MemoryModel(PAPER_SHAPE, PAPER_TP, state_bytes_per_param=MEGATRON_STATE_BYTES)
    layers = PAPER_SHAPE.n_layers // PAPER_PP
    for name, published in PUBLISHED_MEMORY_64K.items():
        cand = paper_candidate(prof, 65536, name, reserve_gb=0.0)
        model = cand.max_bytes / GIB
        base = previous = _paper_peak_gib(prof, name, 0.0, False)
        items: dict[str, float] = {}
        extra = 0.0
        for item, per_token in layer_items.items():
            extra += per_token
            peak = _paper_peak_gib(prof, name, extra, False)
            items[item], previous = peak - previous, peak
        items["K/V prefix copy"] = model - previous
        gather = sp_gather_bytes(cand, PAPER_SHAPE) / GIB
        transient = sp_backward_transient_bytes(cand, PAPER_SHAPE, PAPER_TP) / GIB
        worst = cand.worst_stage  # a rank holds layers / pp layers whatever v is
        state = state_model.state_bytes(layers, worst == 0, worst == PAPER_PP - 1) / GIB
        allocator = slack * (model + gather + transient - state)
        total = model + gather + transient + allocator
        rows.append(
            {
                "schedule": name,
                "published_gib": published,
                "base_gib": base,
                "items_gib": items,
                "model_gib": model,
                "gather_gib": gather,
                "transient_gib": transient,
                "state_gib": state,
                "allocator_gib": allocator,
                "total_gib": total,
                "error": total / published - 1,
                "unattributed_gib": published - total,
            }
        )
    return rows


def claim_30b_rows(prof: GpuProfile) -> list[dict[str, Any]]:
    """The paper's claim "30B at 64k on 64 A100s without recomputation" (which 1F1B cannot):
    each schedule at the fork's exp.sh setting (tp 8 x pp 8, 16 microbatches, K = 4, two
    stages per rank for the interleaved ones), the planner's peak against the profile's
    memory less its reserve."""
    rows = []
    for name in SCHEDULES:
        cand = megatron_candidate(prof, PAPER_30B, 65536, name, pp=8, tp=8, microbatches=16)
        rows.append(
            {
                "schedule": name,
                "claim": "fits" if name.startswith("Seq1F1B") else "does not fit",
                "predicted_gb": cand.max_bytes / GB,
                "budget_gb": cand.budget_bytes / GB,
                "predicted_fits": cand.fits,
            }
        )
    return rows


def cell_observations(cells: Sequence[Cell] = FIT_CELLS) -> list[Observation]:
    """Published cells as observations of :func:`~seq1f1b.planning.fitting.fit_efficiency`:
    each cell's published value against its prediction on the paper's setting; the
    predictions of one profile share their priced steps (a ratio cell reuses its base's)."""
    priced: dict[GpuProfile, Callable[[int, str], float]] = {}

    def predictor(cell: Cell) -> Callable[[GpuProfile], float]:
        def predict(prof: GpuProfile) -> float:
            if prof not in priced:
                priced.clear()  # one profile at a time: the search moves on
                priced[prof] = _tflops_of(prof)
            return cell.predicted(priced[prof])

        return predict

    return [Observation(c.label, predictor(c), c.published()) for c in cells]


def fit(
    prof: GpuProfile,
    cells: Sequence[Cell] = FIT_CELLS,
    *,
    rounds: int = 8,
) -> Efficiency:
    """Efficiencies of ``prof`` fitted to the published ``cells``
    (:func:`~seq1f1b.planning.fitting.fit_efficiency`: squared relative errors, all five
    parameters free)."""
    names = ", ".join(c.label for c in cells)
    return fit_efficiency(
        prof, cell_observations(cells), rounds=rounds, source=f"fitted on {names}"
    )


def _offset_model_gb(pp: int, tp: int, name: str) -> float:
    sched, v, k = SCHEDULES[name]
    setting = Setting(pp, tp, 1, k, PAPER_M, "compute", False, True, sched, v)
    cand = price(setting, PRESETS["paper-7b"], 65536, Hardware(PAPER_GPUS, 80.0, reserve_gb=0.0))
    return cand.max_bytes / GB


def memory_vs_published(splits: tuple[tuple[int, int], ...] = ((4, 8), (8, 4))) -> dict[str, Any]:
    """The torchtitan memory model (no Megatron terms) against the 64k row, at each (pp, tp):
    per schedule the published GB, the model, and at the first split the model plus the offset
    fitted on 1F1B, with its error; the differences between schedules cancel every term that
    does not depend on the activations, so they check the activation model alone."""
    model = {f"pp{p} x tp{t}": {n: _offset_model_gb(p, t, n) for n in SCHEDULES} for p, t in splits}
    main = model[f"pp{splits[0][0]} x tp{splits[0][1]}"]
    offset = PUBLISHED_MEMORY_64K["1F1B"] - main["1F1B"]
    rows = []
    for name, published in PUBLISHED_MEMORY_64K.items():
        sched, v, k = SCHEDULES[name]
        with_offset = main[name] + offset
        rows.append(
            {
                "schedule": name,
                "planner": f"{sched}" + (f" v={v}" if v > 1 else "") + (f" K={k}" if k > 1 else ""),
                "published_gb": published,
                **{key: round(vals[name], 1) for key, vals in model.items()},
                "model_plus_offset_gb": round(with_offset, 1),
                "error": with_offset / published - 1,
                "error_model_alone": main[name] / published - 1,
                "diff_vs_1f1b_published": round(published - PUBLISHED_MEMORY_64K["1F1B"], 1),
                "diff_vs_1f1b_model": round(main[name] - main["1F1B"], 1),
            }
        )
    return {"offset_gb": round(offset, 1), "splits": list(model), "rows": rows}
