"""The dry run (seq1f1b.planning.dryrun) against the same step run for real.

Each pipeline rank's dry-run step (fake tensors, fake process group) is compared with the
same rank's real second step on two gloo ranks, both measured by torch's MemTracker: the peaks
must agree within 5%, under Seq1F1B, ZBSeq1F1B (a split backward: its input half runs
``autograd.grad`` over the received inputs) and torch's 1F1B, so the dry run sees what a real step
holds (receive buffers, K/V cache, gradients, optimizer state), not a model of it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from seq1f1b import ScheduleSeq1F1B, ScheduleZBSeq1F1B
from seq1f1b._runtime import HAS_WARMUP_P2P, PipelineMemTracker
from seq1f1b.attention.gated_deltanet import ChunkAwareGatedDeltaNet
from seq1f1b.attention.mask_mods import CausalBigBird
from seq1f1b.planning.dryrun import RankStep, dry_run_rank, static_stage
from seq1f1b.planning.dryrun.tables import format_holders, format_reports
from seq1f1b.testing import TinyConfig, build_stages

needs_215 = pytest.mark.skipif(HAS_WARMUP_P2P, reason="the dry run needs torch >= 2.15")
CFG = TinyConfig(vocab=512, dim=128, n_heads=4, n_kv_heads=2, n_layers=4, ffn=256)
#: what broke under fake tensors first: sliding windows with sinks (masked tiles read their
#: emptiness, the split balances the window) and Gated DeltaNet layers (state keyed by the
#: key buffer's address, 0 for every fake tensor)
HYBRID = TinyConfig(vocab=512, dim=128, n_heads=4, n_kv_heads=2, n_layers=8, ffn=256,
                    window=48, sinks=4, full_attention_every=2)  # fmt: skip
#: a mask_mod's tiles are planned from its values (outside the dry run's fake tensors)
BIGBIRD = replace(CFG, mask_mod=CausalBigBird(global_tokens=4, window=64, density=0.1, block=32))
CFGS = {"llama": CFG, "hybrid": HYBRID, "bigbird": BIGBIRD}
PP, M, K, BATCH, SEQ = 2, 2, 4, 2, 512


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _schedule(kind: str, stage: PipelineStage, m: int = M, **options):
    if kind == "Seq1F1B":
        return ScheduleSeq1F1B([stage], m, K, _loss, **options)
    if kind == "ZBSeq1F1B":
        return ScheduleZBSeq1F1B([stage], m, K, _loss)
    return Schedule1F1B(stage, m, loss_fn=_loss)


def _batch(batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def _build(kind: str, cfg: str = "llama", m: int = M, options=None, **step_kwargs):
    """This rank's step under fake tensors: stages with static metadata (first unit's shape);
    ``m`` microbatches of one row each past the default's; ``options`` for the schedule."""

    def build(rank: int) -> RankStep:
        mods = build_stages(CFGS[cfg], PP, seed=0)
        unit = SEQ if kind == "1F1B" else SEQ // K  # a segment: a view of its sample
        example = torch.zeros(BATCH // M, SEQ, dtype=torch.long)[:, :unit]
        for s in range(rank):
            example, _ = mods[s](example), None
        stage, _ = static_stage(mods[rank], rank, PP, example)
        opt = torch.optim.AdamW(mods[rank].parameters())
        x = _batch(BATCH // M * m)
        return RankStep(_schedule(kind, stage, m, **(options or {})), [stage], [mods[rank]], opt,
                        (x,) if rank == 0 else (), x if rank == PP - 1 else None,
                        step_kwargs, seq_len=SEQ)  # fmt: skip

    return build


def _real(rank: int, world: int, kind: str, out: str, cfg: str = "llama") -> None:
    """The real run: step 1 warms up (shapes, first-step check, optimizer state), step 2 is
    measured with the same tracker the dry run uses. Gated DeltaNet layers run the delta rule
    as the opaque op a dry run takes (the fused kernel's footprint: inputs saved, no chunk
    temporaries), so both sides hold the same tensors."""
    mods = build_stages(CFGS[cfg], world, seed=0)
    for layer in mods[rank].modules():
        if isinstance(layer, ChunkAwareGatedDeltaNet):
            layer.backend = "op"
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    opt = torch.optim.AdamW(mods[rank].parameters())
    schedule = _schedule(kind, stage)
    x = _batch()

    def step() -> None:
        schedule.step(*((x,) if rank == 0 else ()), target=x if rank == world - 1 else None)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mt = PipelineMemTracker()
    mt.track_external(mods[rank], opt)
    with mt:
        step()
    peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    Path(out, f"{kind}-{rank}.json").write_text(json.dumps(peak))


@needs_215
@pytest.mark.parametrize(("kind", "cfg"), [("Seq1F1B", "llama"), ("1F1B", "llama"),
                                           ("Seq1F1B", "hybrid"), ("Seq1F1B", "bigbird"),
                                           ("ZBSeq1F1B", "llama")])  # fmt: skip
def test_dry_run_peak_matches_the_real_step(kind: str, cfg: str, tmp_path: Path) -> None:
    run_ranks(_real, PP, kind, str(tmp_path), cfg)
    reports = [dry_run_rank(_build(kind, cfg), rank, PP) for rank in range(PP)]
    for rank, report in enumerate(reports):
        real = json.loads((tmp_path / f"{kind}-{rank}.json").read_text())
        assert abs(report.peak.total - real) <= 0.05 * real, (rank, report.peak, real)
        peak = report.peak  # AdamW: two moments per parameter (and a step count per tensor)
        assert abs(peak.optimizer - 2 * peak.parameters) < 0.01 * peak.optimizer
        assert sum(a.label.startswith("F") for a in report.actions) == report.n_units
        assert report.device_s > 0 and report.fits
    text = format_reports(reports)
    assert "rank 0" in text and "rank 1" in text and "fits h100-80gb" in text
    if kind == "Seq1F1B":  # earlier segments' K/V is cached between a sample's units
        assert all(r.peak.kv_cache > 0 for r in reports)
        assert reports[0].n_units == M * K


@needs_215
def test_seq1f1b_holds_less_than_1f1b_on_stage_0() -> None:
    """The method's claim, at a size the dry run makes cheap: K = 4 segments hold
    ((p + K - 1) / K) / p = 5/8 of 1F1B's activations on stage 0 (plus the K/V cache)."""
    seq = dry_run_rank(_build("Seq1F1B"), 0, PP)
    one = dry_run_rank(_build("1F1B"), 0, PP)
    assert seq.peak.activations + seq.peak.kv_cache < 0.8 * one.peak.activations


SIX = 6  # samples of the last stage's step below
#: one unit's input gradient, which the last stage sends upstream
UNIT_GRAD = (BATCH // M, SEQ // K, CFG.dim)


@functools.cache
def _last_stage_of_six(waits: str):
    """The last stage's Seq1F1B step over six samples, with what holds its peak."""
    return dry_run_rank(_build("Seq1F1B", m=SIX, options={"backward_send_waits": waits},
                               return_outputs=False), PP - 1, PP, holders=True)  # fmt: skip


def _sends_at_peak(report) -> int:
    return sum(h.count for h in report.holders[1] if h.kind == "Temp" and h.shape == UNIT_GRAD
               and h.made_by.endswith("(backward)"))  # fmt: skip


@needs_215
@pytest.mark.parametrize("waits", ["end", "consumed"])
def test_the_last_stage_keeps_nothing_of_a_finished_sample(waits: str) -> None:
    """Found at real size (Qwen3.5 9B's last rank held 2.8 GiB more after each sample): each
    unit's loss, kept for ``losses`` with its graph, kept the graph's nodes and every leaf
    they reach (received inputs, cached K/V, their gradients) until the step ended. Between
    the last backwards of consecutive samples, in steady state, the last stage now grows by
    the sample's backward sends under torch's placement of their waits (the step's end), and
    by nothing but its losses once each send is waited for when the peer has it (Llama 3
    70B's last rank held 29 GiB of sent gradients)."""
    held = {a.label: a.memory for a in _last_stage_of_six(waits).actions}
    sends = K * (BATCH // M) * (SEQ // K) * CFG.dim * 4  # fp32 input gradients of a sample
    growth = [held[f"B{K * (i + 1)}"] - held[f"B{K * i}"] for i in range(1, SIX - 2)]
    bound = 1.02 * sends if waits == "end" else 0.01 * sends
    assert all(g <= bound for g in growth), (growth, sends)


@needs_215
def test_the_peak_names_what_holds_it() -> None:
    """``holders=True``: the storages alive within 1% of the peak, each named by the op and
    module that made it, add up to what was held; the optimizer's moments are all there; the
    backward sends held to the step's end are found by their shape, and are gone once each
    is waited for when the peer has it, the peak lower by their bytes."""
    end, consumed = _last_stage_of_six("end"), _last_stage_of_six("consumed")
    for report in (end, consumed):
        held, holders = report.holders
        assert sum(h.nbytes for h in holders) == held
        assert 0.99 * report.peak.total <= held <= report.peak.total
        assert sum(h.nbytes for h in holders if h.kind == "Optstate") == report.peak.optimizer
    assert _sends_at_peak(end) >= 2 * K, end.holders  # two samples' or more
    assert _sends_at_peak(consumed) <= 1, consumed.holders
    unit_bytes = 4 * UNIT_GRAD[0] * UNIT_GRAD[1] * UNIT_GRAD[2]
    saved = (_sends_at_peak(end) - _sends_at_peak(consumed)) * unit_bytes
    assert end.peak.total - consumed.peak.total >= 0.9 * saved
    text = format_holders(end)
    assert "layers.*" in text and "(forward)" in text, text  # one row for every layer's own


@pytest.mark.skipif(not HAS_WARMUP_P2P, reason="torch 2.13/2.14 only")
def test_dry_run_names_the_torch_it_needs() -> None:
    with pytest.raises(RuntimeError, match=r"needs torch 2\.15 or newer"):
        dry_run_rank(_build("1F1B"), 0, PP)


@needs_215
def test_dry_run_refuses_an_initialized_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/s")
    try:
        with pytest.raises(RuntimeError, match="one is initialized already"):
            dry_run_rank(_build("1F1B"), 0, PP)
    finally:
        dist.destroy_process_group()


@needs_215
def test_a_split_backward_last_stage_under_tp_frees_each_unit() -> None:
    """Found by the planner grid (ZBVSeq1F1B x TP 2 x full AC: 9.5 GiB against 0.5 planned):
    the last stage kept what ``step()`` returns, each unit's output, with its graph, and under
    a split backward (the input half retains the graph, the weight half frees only its own
    path) every saved tensor off the weight path stayed alive to the step's end, a unit's
    activations more each unit (none at TP 1 here). Rank 1 of pp 2 x TP 2 under ZBSeq1F1B
    now holds the same after each sample's last weight half."""
    from benchmarks.dry_run.model_ranks import dry_run_isolated

    cfg = TinyConfig(vocab=2048, dim=256, n_heads=8, n_kv_heads=4, n_layers=8, ffn=704)
    args = (cfg, "ZBSeq1F1B", PP, 1, 4, K, 2048, 4, 4, 2, "uniform")
    kwargs = {"ac": "none", "return_outputs": True}  # the kept outputs held the graph
    (report,) = dry_run_isolated([(args, kwargs, 2, 4, "h100-80gb")])
    held = {a.label: a.memory for a in report.actions}
    unit = held["F1"] - held["F0"]  # one unit's forward
    assert held[f"W{2 * K}"] - held[f"W{K}"] < 0.25 * unit, (held, unit)  # sample 2 vs 1


@needs_215
def test_a_split_backward_recomputes_a_checkpointed_block_once_per_weight_half() -> None:
    """Found by the planner grid (ZBVSeq1F1B x full AC: the dry run 2.2x the planner): a block
    checkpointed inside its forward (``torch.utils.checkpoint``, as Hugging Face models do;
    the runtime cannot see it, so the backward is split) was recomputed by torch's weight half
    once per group of weights, each ``autograd.grad`` call a recompute of its own, holding a
    copy each (a Llama block: 9 groups). On rank 1 of ZBSeq1F1B, pp 2, checkpointing then
    raised the peak above the uncheckpointed step's (1.24x) and each W cost 8 forwards more
    than without it; the weight half now recomputes once (``checkpoints_recomputed_once``)."""
    from benchmarks.dry_run.model_ranks import dry_run_isolated

    cfg = TinyConfig(vocab=2048, dim=256, n_heads=8, n_kv_heads=4, n_layers=8, ffn=704)
    args = (cfg, "ZBSeq1F1B", PP, 1, 4, K, 2048, 4, 4, 1, "uniform")
    plain, ckpt = dry_run_isolated([(args, {"ac": ac}, 1, PP, "h100-80gb")
                                    for ac in ("none", "functional")])  # fmt: skip

    def seconds(report, kind: str) -> float:
        return sum(a.device_s for a in report.actions if a.label.startswith(kind))

    forwards = seconds(plain, "F")
    assert seconds(ckpt, "W") - seconds(plain, "W") < 1.5 * forwards, (  # one recompute
        seconds(ckpt, "W"), seconds(plain, "W"), forwards)  # fmt: skip
    assert ckpt.peak.total < 0.6 * plain.peak.total, (ckpt.peak, plain.peak)  # was 1.24x
