"""Loss and every gradient of Seq1F1B equal a single-process full-sequence run (fp32, 1e-5)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from equivalence import (
    Case,
    run_capped_grid,
    run_case,
    run_changing_lengths,
    run_cp_grid,
    run_eval_case,
    run_grid,
    run_hybrid_grid,
    run_mask_grid,
    run_mask_mod_grid,
    run_wide_cp_grid,
    run_with_instance_override,
    run_zb_grid,
    run_zbv_grid,
)

# the 4-rank grids (and the ring of 4) run on the default torch only, their 2-rank (3-rank)
# versions on every release: CI's time budget
FOUR_RANKS = pytest.param(4, marks=pytest.mark.default_release_only)


@pytest.mark.parametrize("stages_per_rank", [1, 2])
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_gradients_match_reference_grid(world: int, stages_per_rank: int) -> None:
    # pp = world ranks; K in {1,2,4}; M in {1,2,3}; uniform, compute-balanced and uneven
    # explicit splits; with and without checkpointing. Every failing case is listed.
    run_ranks(run_grid, world, stages_per_rank)


def _single_rank(rank: int, world: int) -> None:
    for case in (Case(1, 4, 2), Case(4, 3, 2, split=(10, 8, 6)), Case(2, 4, 1, checkpointing=True)):
        run_case(rank, world, case)


@pytest.mark.fast
def test_single_rank_pipeline() -> None:
    # pp = 1: every stage on one rank (looped placement degenerates to sequential stages)
    run_ranks(_single_rank, 1)


def _single_rank_zb_docs(rank: int, world: int) -> None:
    for case in (
        Case(1, 3, 2, docs=True, schedule="ZBSeq1F1B"),
        Case(4, 3, 2, docs=True, checkpointing=True, split=(10, 8, 6)),
        Case(2, 4, 2, docs=True, checkpointing=True, schedule="ZBVSeq1F1B"),  # V of one rank
    ):
        run_case(rank, world, case)


@pytest.mark.fast
def test_single_rank_zero_bubble_and_documents() -> None:
    """World size 1, in one process: the split backward and packed documents (with
    checkpointing over four stages) equal the full-sequence reference (the fast tier)."""
    run_ranks(_single_rank_zb_docs, 1)


def _eval(rank: int, world: int) -> None:
    for case in (
        Case(1, 4, 2),
        Case(2, 3, 2, split=(12, 7, 5)),
        Case(1, 3, 2, docs=True, window=5, sinks=2, pad=True),  # masks, an all-padding unit
    ):
        run_eval_case(rank, world, case)


def test_eval_forward_only_matches_reference() -> None:
    run_ranks(_eval, 2)


@pytest.mark.fast
def test_instance_overrides_of_stage_methods_are_called_and_kept() -> None:
    """The schedule wraps each stage's per-unit methods for a step: around what the stage had,
    an instance override included, which it restores afterwards (it used to call the class's
    method and delete the override)."""
    run_ranks(run_with_instance_override, 1)


@pytest.mark.parametrize(
    ("stages_per_rank", "split"), [(1, "uniform"), (2, "uniform"), (1, "compute")]
)
def test_steps_of_different_lengths_match_reference(stages_per_rank: int, split: str) -> None:
    """24 tokens, then 48, then 24 again, then 36, then eval() at 18, with one schedule: the
    receives are sized for each step's segments (they were sized once, from the first step,
    and a longer step then aborted inside gloo, a shorter one fed the model wrong positions).
    A length an explicit split cannot cut fails on every rank before any traffic."""
    run_ranks(run_changing_lengths, 2, [24, 48, 24, 36], stages_per_rank, split)


@pytest.mark.parametrize("stages_per_rank", [1, 2])
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_masked_gradients_match_reference(world: int, stages_per_rank: int) -> None:
    # packed documents (one spanning three segments, none, boundaries on segment boundaries),
    # sliding windows smaller / equal / larger than a segment, sinks, all-padding units and
    # checkpointing; K in {1,2,3,4}, uneven splits; against the unpipelined model with the
    # same masks
    run_ranks(run_mask_grid, world, stages_per_rank)


@pytest.mark.parametrize("stages_per_rank", [1, 2])
@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_zero_bubble_split_backward_matches_reference(world: int, stages_per_rank: int) -> None:
    # ZBSeq1F1B: BACKWARD_INPUT / BACKWARD_WEIGHT with the cached K/V gradients; K in
    # {1,2,3,4}, uneven splits, checkpointing, documents + window
    run_ranks(run_zb_grid, world, stages_per_rank)


def test_mask_mods_match_reference() -> None:
    """Causal FlexAttention-style ``mask_mod``s (BigBird made causal, a visible prefix) equal
    the unsegmented model under Seq1F1B, InterleavedSeq1F1B, ZBSeq1F1B, ZBVSeq1F1B and CP,
    with documents, checkpointing and padding (the unsegmented model against dense
    attention with the same mask: tests/test_masks.py)."""
    run_ranks(run_mask_mod_grid, 2)


def test_recurrent_state_matches_reference() -> None:
    """A hybrid stack (Gated DeltaNet layers, whose convolution tail and delta-rule state go
    from segment to segment, beside attention) equals the unsegmented model under Seq1F1B,
    InterleavedSeq1F1B, ZBSeq1F1B and ZBVSeq1F1B: documents, checkpointing, uneven splits."""
    run_ranks(run_hybrid_grid, 2)


@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_zbv_seq1f1b_matches_reference(world: int) -> None:
    # ZBVSeq1F1B: V placement (rank r holds stages r and 2pp-1-r, a same-rank handoff at the
    # bottom of the V), split backward; K in {1,2,3,4}, uneven splits, checkpointing,
    # documents + window, padding
    run_ranks(run_zbv_grid, world)


@pytest.mark.parametrize("world", [2, FOUR_RANKS])
def test_context_parallel_matches_reference(world: int) -> None:
    # cp=2 alone (world 2) and pp=2 x cp=2 (world 4): K in {1,2,3,4}, 1 and 2 stages per
    # rank, uneven segments, checkpointing, GQA, packed documents, window + sinks, pass-Q,
    # pass-KV and auto for the cached prefix, ZBSeq1F1B; the whole sequence in one process as
    # the reference
    run_ranks(run_cp_grid, world)


@pytest.mark.parametrize("cp", [3, FOUR_RANKS])
def test_context_parallel_ring_of_three_and_four(cp: int) -> None:
    # cp = 3, 4 (pp = 1): the hops where partial outputs (pass-Q) and gradient accumulators
    # travel with the blocks before returning to their owner
    run_ranks(run_wide_cp_grid, cp)


@pytest.mark.default_release_only  # any split is lengths: explicit splits run on every release
@pytest.mark.parametrize("stages_per_rank", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_memory_capped_split_matches_reference(world: int, stages_per_rank: int) -> None:
    # seq_split="memory_capped": the lengths the simulator picks under an activation cap (uneven in
    # most cases here), K in {1,2,4}, checkpointing, documents + window, ZBSeq1F1B
    run_ranks(run_capped_grid, world, stages_per_rank)
