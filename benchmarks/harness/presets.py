"""Sizes for each benchmark mode: full (REFERENCE section 6's model), quick, and smoke.

Why: one table of every size in one place, so that what ran is stated, not implied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from seq1f1b.testing import TinyConfig

from .measured import RunSpec

__all__ = ["PRESETS", "Preset"]


# pp=2, M=2: the timed comparison
PP2_SPECS = (
    RunSpec("1F1B"),
    RunSpec("GPipe"),
    RunSpec("Interleaved1F1B"),
    RunSpec("Seq1F1B", 2, "compute"),
    RunSpec("Seq1F1B", 4, "uniform"),
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("Seq1F1B", 8, "compute"),
    RunSpec("Seq1F1B", 8, "uniform"),
    RunSpec("ZBSeq1F1B", 4, "compute"),
    RunSpec("ZBSeq1F1B", 8, "uniform"),
    RunSpec("ZBVSeq1F1B", 4, "compute"),
    RunSpec("ZBVSeq1F1B", 8, "compute"),
    RunSpec("ZBVSeq1F1B", 8, "uniform"),
    RunSpec("BitPipe"),
)
# pp=4, M=4: the memory comparison (Interleaved1F1B and BitPipe need layers % 8 == 0)
#: the smoke test's pp=2 runs: every schedule family once (and V placement at two K)
SMOKE_PP2 = ("1F1B", "GPipe", "Interleaved1F1B", "Seq1F1B K=4 compute", "ZBSeq1F1B K=4 compute",
             "ZBVSeq1F1B K=4 compute", "ZBVSeq1F1B K=8 uniform", "BitPipe")  # fmt: skip
SMOKE_BUDGET = ("1F1B", "Seq1F1B K=4 compute", "ZBVSeq1F1B K=8 uniform")
PP4_SPECS = (
    RunSpec("1F1B"),
    RunSpec("GPipe"),
    RunSpec("Interleaved1F1B"),
    RunSpec("Seq1F1B", 2, "compute"),
    RunSpec("Seq1F1B", 4, "uniform"),
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("BitPipe"),
)
BUDGET_SPECS = (
    RunSpec("1F1B"),
    RunSpec("GPipe"),
    RunSpec("Seq1F1B", 2, "compute"),
    RunSpec("Seq1F1B", 4, "uniform"),
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("Seq1F1B", 8, "compute"),
    RunSpec("Seq1F1B", 8, "uniform"),
    RunSpec("ZBSeq1F1B", 8, "uniform"),
    RunSpec("ZBVSeq1F1B", 4, "compute"),
    RunSpec("ZBVSeq1F1B", 8, "compute"),
    RunSpec("ZBVSeq1F1B", 8, "uniform"),
)


@dataclass(frozen=True)
class Preset:
    """Everything a mode runs."""

    name: str
    model: TinyConfig
    seq_lens: tuple[int, ...]  # measured at pp=2, M=2 (timed)
    timed_steps: int
    pp4_seq_len: int  # measured at pp=4, M=4 (memory only)
    pp4_fresh_processes: bool  # one process group per schedule: clean peak RSS, slower
    fit_fractions: tuple[float, ...] = (0.25, 0.5)  # budget fit points, fractions of seq_lens[0]
    sim_pps: tuple[int, ...] = (4, 8)  # simulated at the paper's sizes
    sim_microbatches: tuple[int, ...] = (8, 16)
    sim_seq_lens: tuple[int, ...] = (32768, 65536)
    verify_budget: bool = True
    pp4_specs: tuple[RunSpec, ...] = PP4_SPECS
    long_specs: tuple[RunSpec, ...] = PP2_SPECS  # measured at seq_lens[1:]
    pp2_specs: tuple[RunSpec, ...] = PP2_SPECS  # measured at seq_lens[0] (timed)
    budget_specs: tuple[RunSpec, ...] = BUDGET_SPECS  # the memory-budget search (in pp2_specs)

    def only(self, labels: list[str]) -> Preset:
        """This preset with only the pp=2 runs named (1F1B is always kept: the baseline)."""
        known = {s.label for s in self.pp2_specs}
        unknown = [x for x in labels if x not in known]
        if unknown:
            raise ValueError(f"unknown run labels {unknown}: choose from {sorted(known)}")
        keep = {"1F1B", *labels}
        return replace(
            self,
            pp2_specs=tuple(s for s in self.pp2_specs if s.label in keep),
            budget_specs=tuple(s for s in self.budget_specs if s.label in keep),
            long_specs=tuple(s for s in self.long_specs if s.label in keep),
        )


PRESETS = {
    # REFERENCE section 6's model: Llama-like, hidden 512, 8 heads, 8 layers, SwiGLU, vocab 4096
    "full": Preset(
        name="full",
        model=TinyConfig(vocab=4096, dim=512, n_heads=8, n_kv_heads=8, n_layers=8, ffn=1376),
        seq_lens=(4096, 8192),
        timed_steps=5,
        long_specs=(
            RunSpec("1F1B"),
            RunSpec("Seq1F1B", 4, "uniform"),
            RunSpec("Seq1F1B", 4, "compute"),
            RunSpec("Seq1F1B", 8, "compute"),
            RunSpec("ZBSeq1F1B", 4, "compute"),
            RunSpec("BitPipe"),
        ),
        pp4_seq_len=4096,
        pp4_fresh_processes=True,
    ),
    # a quarter of the width, half the depth: the same 4096 tokens, in minutes on 2 cores
    # (4 layers: Interleaved1F1B and BitPipe cannot run at pp=4, which needs 8 stages)
    "quick": Preset(
        name="quick",
        model=TinyConfig(vocab=1024, dim=128, n_heads=2, n_kv_heads=2, n_layers=4, ffn=344),
        seq_lens=(4096,),
        timed_steps=3,
        pp4_seq_len=2048,
        pp4_fresh_processes=False,
        verify_budget=False,
    ),
    # the smoke test's: every code path (each schedule family once), tiny sizes
    "smoke": Preset(
        name="smoke",
        model=TinyConfig(vocab=64, dim=32, n_heads=2, n_kv_heads=2, n_layers=8, ffn=64),
        seq_lens=(256,),
        timed_steps=1,
        pp4_seq_len=128,
        sim_pps=(4,),
        sim_microbatches=(8,),
        sim_seq_lens=(32768,),
        pp4_fresh_processes=False,
        verify_budget=False,
        pp4_specs=(RunSpec("1F1B"), RunSpec("Seq1F1B", 4, "uniform"), RunSpec("BitPipe")),
        pp2_specs=tuple(s for s in PP2_SPECS if s.label in SMOKE_PP2),
        budget_specs=tuple(s for s in BUDGET_SPECS if s.label in SMOKE_BUDGET),
    ),
}
