"""Smoke test of ``python -m benchmarks.dry_run.host_overhead``: one case at a tiny size runs
all three measurements (the fake-tensor step with its op counts and device estimate, the
real-tensor miniature with its first-step check, the dry run itself), and the tables print.
The real-size numbers are a benchmark (the module docstring), not a test."""

from __future__ import annotations

import pytest

from benchmarks.dry_run import host_overhead as ho
from benchmarks.dry_run.stack_sampler import CAUSES, cause_of
from seq1f1b._runtime import HAS_WARMUP_P2P
from seq1f1b.testing import TinyConfig

# benchmark tooling: on the default release only; the dry run itself needs torch >= 2.15
pytestmark = [
    pytest.mark.default_release_only,
    pytest.mark.skipif(HAS_WARMUP_P2P, reason="the dry run needs torch >= 2.15"),
]

TINY = TinyConfig(vocab=128, dim=64, n_heads=4, n_kv_heads=2, n_layers=4, ffn=128)


def test_the_family_is_every_sequence_chunked_schedule() -> None:
    assert set(ho.SCHEDULES) == {"Seq1F1B", "InterleavedSeq1F1B", "ZBSeq1F1B", "ZBVSeq1F1B"}


def test_miniature_keeps_the_layers_and_the_head_ratio() -> None:
    mini = ho.miniature_config(ho.Setting().cfg)
    assert (mini.n_layers, mini.n_heads // mini.n_kv_heads) == (32, 4)
    assert mini.dim // mini.n_heads == 4


@pytest.mark.parametrize(("name", "stages"), [("Seq1F1B", 1), ("ZBVSeq1F1B", 2)])
def test_one_tiny_case_measures_and_reports(name: str, stages: int) -> None:
    """Rank 1's step at K = 2: M * K units a stage, segments of 1 and 2 tiles a layer (the
    split backward's V placement: two stages of half the layers)."""
    setting = ho.Setting(TINY, seq_len=256, pp=2, microbatches=2, loss_chunks=4, steps=1, pairs=1)
    result = ho.measure(ho.Case(name, 2, 1), setting)
    assert result.units == 4 * stages and result.device_s > 0
    assert result.tiles == pytest.approx(1.5 * TINY.n_layers / 2 / stages)
    assert result.kernels > result.tiles > 0 and result.views > 0
    assert result.fake.get("fake dispatch", 0.0) > 0 and result.host(result.mini) > 0
    assert set(result.mini) <= {*CAUSES, "pre-flight", "measurement", "fake dispatch"}
    assert result.dry_run_s is not None and result.dry_run_s > 0
    text = ho.report([result], setting)
    assert f"| {name} | 2 | 1 | {4 * stages} |" in text and "first-step check" in text


def test_causes_follow_the_innermost_frame_that_names_one() -> None:
    def code(path: str, name: str):
        return compile("pass", path, "exec").replace(co_name=name)

    tiles = code("/x/seq1f1b/attention/tiles.py", "run_tiles_forward")
    glue = code("/usr/lib/python3.11/contextlib.py", "__enter__")
    fake = code("/v/site-packages/torch/_subclasses/fake_tensor.py", "dispatch")
    stage = code("/v/site-packages/torch/distributed/pipelining/stage.py", "forward_one_chunk")
    pre = code("/x/seq1f1b/schedules/sequence_schedule.py", "_get_microbatch_inputs")
    assert cause_of((glue, tiles, stage)) == "tiles"
    assert cause_of((fake, glue, tiles, stage)) == "fake dispatch"
    assert cause_of((stage,)) == "schedule"
    assert cause_of((tiles, pre)) == "pre-flight"
