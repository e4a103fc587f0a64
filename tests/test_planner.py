"""The planner answers "which pp / TP / K / M" from a model, a sequence length and GPUs, and its
models agree with hand computation and with the published 7B memory outcome. Each setting is
priced in the precision its trainer really runs (torchtitan 0.2.2: fp32 without FSDP under PP or
TP), and the TOML says so."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from seq1f1b import _runtime as rt
from seq1f1b.planning import planner
from seq1f1b.planning import search as search_module
from seq1f1b.planning.costmodel import FP32_SLOWDOWN, PRESETS, Hardware, MemoryModel
from seq1f1b.planning.planner import (
    BF16,
    Candidate,
    Filters,
    Setting,
    Trainer,
    build_parser,
    format_plan,
    main,
    price,
    problem_from_args,
    search,
)
from seq1f1b.registry import REGISTRY
from seq1f1b.schedules.partition import ModelShape
from torchtitan_integration.planner import TORCHTITAN_022, TORCHTITAN_03, TRAINERS, launch_lines
from torchtitan_integration.planner import main as toml_main

LLAMA8B = PRESETS["llama3-8b"]
PAPER7B = PRESETS["paper-7b"]


def test_presets_have_the_published_parameter_counts() -> None:
    def total(s: ModelShape) -> float:
        return s.n_layers * s.params_per_layer + 2 * s.vocab * s.hidden

    assert total(LLAMA8B) == pytest.approx(8.03e9, rel=2e-3)  # Llama 3 8B
    assert total(PRESETS["llama3-70b"]) == pytest.approx(70.6e9, rel=2e-3)  # Llama 3 70B
    # mixtures of experts: weights by every expert, FLOPs by the active ones (Qwen's and
    # OpenAI's published totals; DeepSeek-V3's MLA is priced as full-rank heads: docs/planner.md)
    moe = PRESETS["qwen3-30b-a3b"]
    assert total(moe) == pytest.approx(30.5e9, rel=5e-3)
    active = dataclasses.replace(moe, ffn_total=moe.ffn_hidden)
    assert total(active) == pytest.approx(3.3e9, rel=2e-2)
    assert total(PRESETS["gpt-oss-120b"]) == pytest.approx(116.8e9, rel=5e-3)
    assert MemoryModel(moe).layer_bytes_per_token(False) == MemoryModel(
        active
    ).layer_bytes_per_token(False)  # activations follow the experts a token runs


def test_memory_model_matches_hand_computation() -> None:
    # b * (4H + 2*h*d + 2*h_kv*d + 4F) + 4h = 2 * (16384 + 8192 + 2048 + 57344) + 128
    assert MemoryModel(LLAMA8B).layer_bytes_per_token(False) == 168064
    assert MemoryModel(LLAMA8B, tp=4).layer_bytes_per_token(False) == 168064 / 4
    # full recompute keeps the layer input, plus earlier segments' K/V when segmented
    ac = MemoryModel(LLAMA8B, recompute=True)
    assert ac.layer_bytes_per_token(False) == 2 * 4096
    assert ac.layer_bytes_per_token(True) == 2 * 4096 + 2 * 2 * 8 * 128


def test_llama3_8b_on_8_gpus_gets_a_ranked_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Where the trainer casts at every degree (torchtitan 0.3): a ranked plan over every
    schedule of the registry; with a pipeline, Seq1F1B beats 1F1B at 32k."""
    argv = "--model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80".split()
    argv += ["--precision", "torchtitan-0.3"]
    assert main(argv, TRAINERS) == 0
    out = capsys.readouterr().out
    assert "Recommendation (*):" in out
    assert main([*argv, "--json", "--top", "2000"], TRAINERS) == 0
    doc = json.loads(capsys.readouterr().out)
    rows, best = doc["candidates"], doc["recommended"]
    s = best["setting"]
    # the recommendation: the least memory (to 1 GB) among those within the assumed 2% of
    # the fastest (the tie group of the assumed-constants model)
    fastest = max(r["tokens_per_second_per_gpu"] for r in rows if r["fits"])
    near = [r for r in rows if r["fits"] and r["tokens_per_second_per_gpu"] >= 0.98 * fastest]
    assert best in near
    assert round(max(best["peak_bytes"]) / 1e9) == min(
        round(max(r["peak_bytes"]) / 1e9) for r in near
    )
    assert best["fits"] and s["pp"] * s["tp"] * s["fsdp"] == 8
    assert s["microbatches"] * s["fsdp"] == 16  # default global batch: 2 x GPUs
    # fitting settings come first, then the rest by throughput; a fitting row is never
    # faster than the model's error over a row ranked before it (ties only inside a group)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)
    speed = [r["tokens_per_second_per_gpu"] for r in rows if r["fits"]]
    assert all(later * 0.98 <= first for i, first in enumerate(speed) for later in speed[i:])
    assert speed != sorted(speed, reverse=True)  # some ties were reordered by memory
    slow = [r["tokens_per_second_per_gpu"] for r in rows if not r["fits"]]
    assert slow == sorted(slow, reverse=True)
    # every registry schedule whose stages divide the 32 layers at some pp was priced
    names = {r["setting"]["name"] for r in rows if r["setting"]["pp"] > 1}
    assert {e.name for e in REGISTRY} <= names
    # 1F1B's bubble at pp 8 is at least the equal-stage (p-1)/(M+p-1) (the last stage also
    # runs the output layer); Seq1F1B K=8 at the same degrees has a smaller one
    one = {
        (r["setting"]["tp"], r["setting"]["recompute"]): r
        for r in rows
        if r["setting"]["name"] == "1F1B" and r["setting"]["pp"] == 8
    }
    assert one and all(r["bubble"] >= 7 / 23 - 1e-9 for r in one.values())
    for r in rows:
        t = r["setting"]
        if t["name"] == "Seq1F1B" and t["pp"] == 8 and t["seq_chunks"] == 8:
            assert r["bubble"] < 0.75 * one[(t["tp"], t["recompute"])]["bubble"]
            assert (
                r["tokens_per_second_per_gpu"]
                > one[(t["tp"], t["recompute"])]["tokens_per_second_per_gpu"]
            )


def test_recomputation_trades_memory_for_time() -> None:
    hw = Hardware(8, 80.0)
    p = search(
        LLAMA8B, 32768, hw, 16, pp=[4], tp=[2], chunks=(4,), splits=("compute",),
        schedules=("Seq1F1B",),
    )  # fmt: skip
    by_ac = {c.setting.recompute: c for c in p.candidates if c.setting.seq_chunks == 4}
    assert by_ac[True].max_bytes < by_ac[False].max_bytes
    assert by_ac[True].step_seconds > 1.3 * by_ac[False].step_seconds


def test_published_7b_outcome_at_128k_is_reproduced() -> None:
    """Paper: 7B on 32 GPUs of 80 GB without recomputation, 128k tokens: 1F1B out of memory,
    Seq1F1B runs; at 64k both run and Seq1F1B needs clearly less memory (34.3 vs 51.4 GB)."""
    hw = Hardware(32, 80.0, reserve_gb=0.0)
    kw = dict(pp=[8], tp=[4], chunks=(1, 4), splits=("compute",), recompute=(False,))
    kw["schedules"] = ("1F1B", "Seq1F1B")
    long = {c.setting.seq_chunks: c for c in search(PAPER7B, 131072, hw, 8, **kw).candidates}
    assert not long[1].fits and long[4].fits
    mid = {c.setting.seq_chunks: c for c in search(PAPER7B, 65536, hw, 8, **kw).candidates}
    assert mid[1].fits and mid[4].max_bytes < 0.7 * mid[1].max_bytes


def test_constraints_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    p = search(PRESETS["llama3-70b"], 65536, Hardware(24, 80.0), 24, pp=[3, 8])
    assert any("pp=3: does not divide the 80 layers" in why for why in p.skipped)
    assert {c.setting.pp for c in p.candidates} == {8}
    assert main("--model llama3-8b --hidden 8 --seq-len 8 --gpus 1 --gpu-memory-gb 1".split()) == 2
    assert "not both" in capsys.readouterr().err
    assert main("--seq-len 8 --gpus 1 --gpu-memory-gb 80".split()) == 2
    assert "give --model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="n_kv_heads=5 must divide n_heads=32"):
        ModelShape(4096, 32, 32, 1000, n_kv_heads=5)


def test_nothing_fits_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "--model llama3-70b --seq-len 131072 --gpus 2 --gpu-memory-gb 24 --top 3".split()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "No setting fits. The lowest is" in out
    assert search(LLAMA8B, 8192, Hardware(2, 80.0), 2).best is not None


def test_a_comparison_the_filters_ruled_out_says_so() -> None:
    """``--pp 2 --schedules Seq1F1B`` prices no plain 1F1B and nothing without pipelining: the
    plan says the filters excluded them, not that none fits (both fit without the filters);
    a comparison priced but not fitting still says "none fits", naming the filters it was
    priced within."""
    hw, split = Hardware(2, 80.0), {"chunks": [2, 4], "min_segment": 1024}
    text = format_plan(search(LLAMA8B, 8192, hw, 4, pp=[2], schedules=["seq1f1b"], **split))
    assert "the best plain 1F1B: excluded by your filters (--schedules Seq1F1B)" in text
    assert "the best without pipelining: excluded by your filters (--pp 2)" in text
    assert "the best without recomputation: none fits within your filters (--pp 2 " in text
    free = search(LLAMA8B, 8192, hw, 4, **split)
    assert free.best_where(lambda s: s.pp == 1) and free.best_where(planner._is_baseline)
    assert "the best plain 1F1B (pp2 tp1 fsdp1 M=4 1F1B" in format_plan(free)
    assert free.filters == Filters() and free.filters.given() == []
    # --pp listing every divisor of the GPUs filters nothing; --ac full rules out "no AC"
    full_ac = search(LLAMA8B, 8192, hw, 4, pp=[1, 2], recompute=(True,), **split)
    assert full_ac.filters.given() == ["--ac full"]
    assert "the best without recomputation: excluded by your filters (--ac full)" in (
        format_plan(full_ac)
    )
    assert Filters(recompute=frozenset()).excluding("no-ac") == ["--ac selective"]


def test_bf16_only_where_the_trainer_casts() -> None:
    grid = [(pp, tp, f) for pp in (1, 2) for tp in (1, 2) for f in (1, 2)]
    # torchtitan 0.2.2: FSDP's mixed-precision policy, or autocast with nothing parallel
    assert {g for g in grid if TORCHTITAN_022.runs_in_bf16(*g)} == {
        (1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 2)
    }  # fmt: skip
    assert all(t.runs_in_bf16(*g) for g in grid for t in (TORCHTITAN_03, BF16))
    # the library's command knows no torchtitan: its --precision names only its own trainer
    assert [t.name for t in TRAINERS] == ["torchtitan-0.3", "torchtitan-0.2", "bf16"]
    args = "--model llama3-8b --seq-len 8192 --gpus 2 --gpu-memory-gb 80".split()
    assert build_parser().parse_args(args).precision == "bf16"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--precision", "torchtitan-0.3"])


def test_rule_matches_installed_torchtitan_0_2() -> None:
    """The torchtitan-0.2 rule is what the installed torchtitan 0.2.2 does: autocast only with
    nothing parallel (``maybe_enable_amp``), FSDP's bf16 policy wherever it shards (its
    llama3 ``parallelize`` applies FSDP exactly when ``fsdp_enabled``). Checked in a
    subprocess: importing torchtitan fixes its device."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "protocols" / "train_spec.py").exists():
        pytest.skip("torchtitan 0.3+: no maybe_enable_amp (FSDP casts at every degree)")
    code = (
        "import types, torch\n"
        "from torchtitan.distributed.utils import maybe_enable_amp\n"
        "for pp, tp, f in [(a, b, c) for a in (1, 2) for b in (1, 2) for c in (1, 2)]:\n"
        "    d = types.SimpleNamespace(fsdp_enabled=f > 1, tp_enabled=tp > 1, pp_enabled=pp > 1)\n"
        "    amp = isinstance(maybe_enable_amp(d, 'bfloat16', 'cpu'), torch.autocast)\n"
        "    print('RULE', pp, tp, f, int(amp or f > 1))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RULE")]
    assert len(rows) == 8
    for pp, tp, f, bf16 in (map(int, r) for r in rows):
        assert TORCHTITAN_022.runs_in_bf16(pp, tp, f) == bool(bf16), (pp, tp, f)


def test_fp32_settings_are_priced_in_fp32() -> None:
    """PP without FSDP under torchtitan 0.2.2: 4-byte activations and fp32 matmul throughput
    (no TP, so no collectives: exactly FP32_SLOWDOWN times the bf16 step)."""
    fp32 = MemoryModel(LLAMA8B, dtype_bytes=4).layer_bytes_per_token(False)
    assert fp32 == 4 * (16384 + 8192 + 2048 + 57344) + 128
    hw = Hardware(2, 80.0)

    def by_k(trainer: Trainer) -> dict[int, Candidate]:
        plan = search(
            LLAMA8B, 8192, hw, 4, pp=[2], chunks=(2,), splits=("compute",), recompute=(True,),
            trainer=trainer,
        )  # fmt: skip
        return {c.setting.seq_chunks: c for c in plan.candidates}

    tt, bf = by_k(TORCHTITAN_022), by_k(BF16)
    for k in (1, 2):
        assert not tt[k].setting.bf16 and bf[k].setting.bf16
        assert tt[k].step_seconds == pytest.approx(FP32_SLOWDOWN * bf[k].step_seconds)
        assert tt[k].peak_bytes[0] > bf[k].peak_bytes[0]  # twice the activation bytes
        assert tt[k].why().startswith("fp32 (bf16 needs FSDP)")
        assert tt[k].setting.label().endswith(", fp32")
    assert Hardware(1, 80.0, tflops=300.0).fp32_throughput == 300.0 / FP32_SLOWDOWN
    assert Hardware(1, 80.0, fp32_tflops=50.0).fp32_throughput == 50.0


def test_never_recommends_bf16_that_would_run_in_fp32(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Priced for torchtitan 0.2.2 (``--precision torchtitan-0.2``; 0.3 is the default): its
    recommendation at 32k on 8 GPUs is a setting that really trains in bf16 there, and fp32
    rows say why they are slow."""
    argv = (
        "--precision torchtitan-0.2 --model llama3-8b --seq-len 32768 --gpus 8 "
        "--gpu-memory-gb 80 --json --top 200"
    )
    assert main(argv.split(), TRAINERS) == 0
    doc = json.loads(capsys.readouterr().out)
    s = doc["recommended"]["setting"]
    assert s["bf16"] and (s["fsdp"] > 1 or s["pp"] == s["tp"] == 1)
    for row in doc["candidates"]:
        r = row["setting"]
        assert r["bf16"] == TORCHTITAN_022.runs_in_bf16(r["pp"], r["tp"], r["fsdp"])
    assert any(not row["setting"]["bf16"] for row in doc["candidates"])
    assert main(argv.split()[:-3], TRAINERS) == 0
    assert "precision: torchtitan 0.2.2: bf16 where FSDP shards" in capsys.readouterr().out


def test_fsdp_under_a_pipeline_holds_the_stage_unsharded() -> None:
    """torch's pipeline stage turns FSDP's gradient sync off until the last backward and
    torchtitan keeps PP stages gathered after forward: the whole stage's bf16 weights and
    fp32 accumulated gradients stay unsharded; without PP two layers at a time."""
    s, layers, tp = LLAMA8B, 16, 2
    params = layers * s.params_per_layer + s.vocab * s.hidden  # first stage: + embedding
    sharded = params * 16 / (tp * 4)
    pp = MemoryModel(LLAMA8B, tp=tp, fsdp=4, pipelined=True)
    assert pp.state_bytes(layers, True, False) == pytest.approx(sharded + params * 6 / tp)
    flat = MemoryModel(LLAMA8B, tp=tp, fsdp=4)
    assert flat.state_bytes(layers, True, False) == pytest.approx(
        sharded + 8 * s.params_per_layer / tp
    )
    # torchtitan 0.3 wraps FSDP at degree 1 too: the same copies without sharding
    wrapped = MemoryModel(LLAMA8B, tp=tp, fsdp=1, pipelined=True, fsdp_wrapped=True)
    assert wrapped.state_bytes(layers, True, False) == pytest.approx(params * (16 + 6) / tp)
    assert MemoryModel(LLAMA8B, tp=tp, pipelined=True).state_bytes(layers, True, False) == (
        pytest.approx(params * 16 / tp)
    )


@pytest.mark.parametrize("precision", [t.name for t in TRAINERS])
def test_toml_states_the_priced_precision(precision: str, tmp_path: Path) -> None:
    """``mixed_precision_param`` in the TOML is the precision the plan was priced in."""
    tomllib = pytest.importorskip("tomllib")
    out = tmp_path / "plan.toml"
    argv = "--model llama3-8b --seq-len 8192 --gpus 2 --gpu-memory-gb 141 --pp 2 --ac full"
    assert toml_main([*argv.split(), "--precision", precision, "--output", str(out)]) == 0
    text = out.read_text()
    doc = tomllib.loads(text)
    assert doc["parallelism"]["data_parallel_shard_degree"] == 1
    assert doc["parallelism"]["pipeline_parallel_degree"] == 2
    want = "float32" if precision == "torchtitan-0.2" else "bfloat16"
    assert doc["training"]["mixed_precision_param"] == want
    assert f"priced for --precision {precision}" in text
    if precision != "torchtitan-0.2":
        assert "0.2.2 would run this in fp32" in text


def test_toml_launch_command_is_the_real_multi_node_one() -> None:
    assert launch_lines(8) == ["# Launch: CONFIG_FILE=<this file> NGPU=8 ./run_train.sh"]
    assert launch_lines(4) == ["# Launch: CONFIG_FILE=<this file> NGPU=4 ./run_train.sh"]
    many = "\n".join(launch_lines(64))
    assert "NGPU=8 NNODES=8 NODE_RANK=<0..7> RDZV_ENDPOINT=<node 0 host>:29500" in many
    assert "sbatch --nodes=8 --gpus-per-node=8 examples/slurm_run_train.sh" in many
    assert "NGPU=6 NNODES=2" in "\n".join(launch_lines(12))  # equal shares, not 8 + 4
    assert "NGPU=4 NNODES=4" in "\n".join(launch_lines(16, gpus_per_node=4))
    with pytest.raises(ValueError):
        launch_lines(0)


SMALL = ModelShape(1024, 8, 8, 32000, ffn_hidden=4096)


def _by_name(plan_pp: int = 2, m: int = 4, **kw: object) -> dict[str, Candidate]:
    """The planner's candidates at pp=2 (tp=1, no AC), one per schedule (its first K)."""
    plan = search(
        SMALL, 8192, Hardware(plan_pp, 80.0), m, pp=[plan_pp], tp=[1], recompute=(False,),
        chunks=(1, 4), splits=("compute",), min_segment=1, **kw,
    )  # fmt: skip
    out: dict[str, Candidate] = {}
    for c in plan.candidates:
        out.setdefault(c.setting.schedule_text(), c)
    return out


def test_search_covers_every_registry_schedule() -> None:
    """Each registry entry is priced with its own order: stages per rank from its placement,
    K > 1 only for sequence-chunked ones, BitPipe's two replicas."""
    got = _by_name()
    names = {c.setting.name for c in got.values()}
    assert names == {e.name for e in REGISTRY}
    for c in got.values():
        e = c.setting.entry
        assert e is not None and (c.setting.seq_chunks > 1) == e.seq_chunked
        assert e.min_stages_per_rank <= c.setting.stages_per_rank
        assert c.step_seconds > 0 and c.bubble >= 0
    # interleaving shrinks 1F1B's bubble; sequence chunks shrink it further
    assert got["Interleaved1F1B v=2"].bubble < got["1F1B"].bubble
    assert got["Seq1F1B K=4 compute"].bubble < got["1F1B"].bubble
    assert search(SMALL, 8192, Hardware(2, 80.0), 4, pp=[2], schedules=["bitpipe"]).candidates
    with pytest.raises(ValueError, match="unknown"):
        search(SMALL, 8192, Hardware(2, 80.0), 4, pp=[2], schedules=["NoSuch"])


def test_memory_follows_each_schedules_order() -> None:
    """Peak activations per rank come from the simulated order, not one formula: GPipe holds
    all M microbatches on rank 0, 1F1B pp of them, Seq1F1B K=4 (pp+K-1)/K; BitPipe holds two
    replicas' weights (twice 1F1B's model state)."""
    m = 8
    got = _by_name(m=m)
    mem = MemoryModel(SMALL, pipelined=True)
    layers = SMALL.n_layers // 2
    state0 = mem.state_bytes(layers, True, False)
    one = mem.unit_bytes(8192, layers, False, False)

    def act(name: str) -> float:
        return got[name].peak_bytes[0] - state0

    assert act("GPipe") == pytest.approx(m * one)
    assert act("1F1B") == pytest.approx(2 * one)
    seg = mem.unit_bytes(1, layers, False, True)  # per token, segmented
    lengths = got["Seq1F1B K=4 compute"].segment_lengths
    # warm-up p-r+K-2 = 4 forwards (one sample), then F/B pairs: a segment of the next sample
    # enters before one of the first leaves (segments differ in length under compute split)
    low, high = sum(lengths) + lengths[0], sum(lengths) + lengths[0] + lengths[1] - lengths[3]
    assert low * seg <= act("Seq1F1B K=4 compute") <= high * seg + 1
    assert act("Seq1F1B K=4 compute") < 0.7 * act("1F1B")
    # BitPipe: rank 0 holds 4 chunks of L/4 layers of two replicas: twice the stage's weights
    bit = got["BitPipe"].setting
    assert bit.entry is not None and bit.entry.replicas == 2
    quarter = SMALL.n_layers // 4
    bit_state = mem.state_bytes(quarter, True, False) + 3 * mem.state_bytes(quarter, False, False)
    assert bit_state > 1.9 * mem.state_bytes(layers, False, False)
    assert got["BitPipe"].peak_bytes[0] > bit_state


def test_context_parallel_halves_activations_and_pays_the_ring() -> None:
    """cp=2 on 4 GPUs (pp 2 x cp 2) against pp 2 x FSDP 2: half the activations per rank,
    the ring's traffic added to the step."""
    plan = search(
        SMALL, 16384, Hardware(4, 80.0), 4, pp=[2], tp=[1], cp=[1, 2], chunks=(4,),
        splits=("compute",), recompute=(False,), schedules=["Seq1F1B"], min_segment=1,
    )  # fmt: skip
    by_cp = {c.setting.cp: c for c in plan.candidates}
    assert set(by_cp) == {1, 2}
    one, two = by_cp[1], by_cp[2]
    assert two.setting.fsdp == 1 and one.setting.fsdp == 2 and two.setting.microbatches == 4
    mem1 = MemoryModel(SMALL, fsdp=2, pipelined=True)
    act1 = one.peak_bytes[0] - mem1.state_bytes(4, True, False)
    act2 = two.peak_bytes[0] - mem1.state_bytes(4, True, False)  # CP ranks shard state too
    assert act2 == pytest.approx(act1 / 2, rel=1e-3)  # segment lengths: multiples of 2*cp
    # cp=2 runs twice the microbatches on half the tokens each: compute alike, plus the ring
    assert two.step_seconds > one.step_seconds
    assert "cp2" in two.setting.label()


def test_published_7b_memory_differences_are_reproduced() -> None:
    """Paper, 7B on 32 GPUs at 64k, M = 8 (GB per GPU): 1F1B 51.4, 1F1B-I 62.9, Seq1F1B 34.3.
    At pp 8 x tp 4 1F1B alone is far above 51.4 (one microbatch of all layers / tp), so the
    paper ran tp 8; there the differences between schedules, free of every term that does not
    depend on activations, match the published ones (benchmarks/planner_models/vs_published.py)."""
    hw = Hardware(32, 80.0, reserve_gb=0.0)

    def gb(pp: int, tp: int, name: str, v: int = 1, k: int = 1) -> float:
        s = Setting(pp, tp, 1, k, 8, "compute", False, True, name, v)
        return price(s, PAPER7B, 65536, hw).max_bytes / 1e9

    assert gb(8, 4, "1F1B") > 51.4 + 15
    one = gb(4, 8, "1F1B")
    assert one - gb(4, 8, "Seq1F1B", k=4) == pytest.approx(51.4 - 34.3, rel=0.05)
    assert gb(4, 8, "Interleaved1F1B", v=2) - one == pytest.approx(62.9 - 51.4, rel=0.15)


def test_zero_bubble_orders_under_checkpointing_are_priced_as_they_run() -> None:
    """Under full or selective AC the Seq1F1B family's zero-bubble orders run each backward
    whole (torchtitan wraps each block), and are priced so: no weight half in the order, the
    peak of the split order. torch's own zero-bubble schedules keep their weight half, which
    recomputes each checkpointed block once per weight group, so they are not priced under
    AC, with the reason (the planner would otherwise price their W without a recompute)."""
    from seq1f1b.planning.pricing import _order, runs_whole

    hw = Hardware(8, 80.0, tflops=400.0, inter_node_gbps=50.0)
    plan = search(
        PRESETS["llama3-8b"], 32768, hw, 8, pp=[2], tp=[1], cp=[1], chunks=[1, 4],
        splits=("uniform",), selective=True, trainer=TORCHTITAN_03,
        schedules=["ZBSeq1F1B", "ZBVZeroBubble"],
    )  # fmt: skip
    modes = {(c.setting.schedule, c.setting.ac) for c in plan.candidates}
    assert {("ZBSeq1F1B", ac) for ac in ("none", "full", "selective")} <= modes
    assert ("ZBVZeroBubble", "none") in modes
    assert not {("ZBVZeroBubble", "full"), ("ZBVZeroBubble", "selective")} & modes
    assert any("ZBVZeroBubble with activation checkpointing: not priced" in w
               for w in plan.skipped)  # fmt: skip
    full = next(c.setting for c in plan.candidates
                if c.setting.schedule == "ZBSeq1F1B" and c.setting.ac == "full")  # fmt: skip
    assert runs_whole(full)
    kinds = {a.computation_type for o in _order(full, {}).values() for a in o if a is not None}
    assert rt.BACKWARD_WEIGHT not in kinds and rt.BACKWARD_INPUT not in kinds
    split = dataclasses.replace(full, recompute=False)
    assert not runs_whole(split)
    assert rt.BACKWARD_WEIGHT in {a.computation_type for o in _order(split, {}).values()
                                  for a in o if a is not None}  # fmt: skip


def test_selective_ac_is_priced_between_none_and_full() -> None:
    """torchtitan's selective AC: it keeps less than no AC and more than full AC, its
    backward costs more than no AC's and less than full AC's, with whole sequences and with
    segments (K = 4: the compiled chunk-aware attention kept, as the integration's policy
    does); K > 1 under context parallelism (the ring's eager kernels) is skipped with the
    reason."""
    hw = Hardware(8, 80.0, tflops=400.0, inter_node_gbps=50.0)
    plan = search(
        PRESETS["llama3-8b"], 32768, hw, 16, pp=[1, 2], tp=[1], cp=[1, 2], chunks=[1, 4],
        splits=("uniform",), selective=True, trainer=TORCHTITAN_03,
        schedules=["1F1B", "Seq1F1B"],
    )  # fmt: skip
    by: dict[tuple, dict[str, Candidate]] = {}
    for c in plan.candidates:
        s = c.setting
        by.setdefault((s.pp, s.seq_chunks, s.cp), {})[s.ac] = c
    assert all("selective" not in modes for (pp, k, cp), modes in by.items() if k > 1 < cp)
    assert "selective" in by[(2, 4, 1)]
    assert any("selective AC with K > 1 and cp > 1: not priced" in w for w in plan.skipped)
    for key in [(1, 1, 1), (2, 1, 1), (2, 4, 1)]:
        none, sel, full = (by[key][m] for m in ("none", "selective", "full"))
        assert none.step_seconds < sel.step_seconds < full.step_seconds, key
        assert full.max_bytes < sel.max_bytes < none.max_bytes, key
        assert sel.setting.label().endswith("selective AC")
    with pytest.raises(ValueError, match="full or selective"):
        Setting(1, 1, 8, 1, 2, "uniform", True, True, selective=True)


def test_toml_of_a_selective_plan(tmp_path: Path) -> None:
    """A plan with selective AC says so in torchtitan's words (0.2.2's op-level option too)."""
    tomllib = pytest.importorskip("tomllib")
    out = tmp_path / "plan.toml"
    argv = "--model llama3-8b --seq-len 8192 --gpus 8 --gpu-memory-gb 80 --pp 1 --tp 1"
    assert toml_main([*argv.split(), "--ac", "selective", "--output", str(out)]) == 0
    doc = tomllib.loads(out.read_text())
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


def test_latent_kv_cache_is_priced_and_chosen_where_only_it_fits(tmp_path: Path) -> None:
    """MLA's latent K/V cache: 576 values a token a layer at DeepSeek-V3 671B instead of
    40,960 (<= 1/20); its re-expansion makes a step slower where both caches fit, and the
    planner takes it where only it fits (a DeepSeek-V3 16B-shaped model, 128k tokens on 80 GB
    GPUs, K = 16 under full AC), writing ``kv_cache = "latent"`` into the TOML."""
    big = PRESETS["deepseek-v3-671b"]
    assert big.latent_kv is not None
    assert 20 * big.latent_kv.cached <= 2 * big.n_kv_heads * big.head_dim
    expanded = MemoryModel(big, 1, 1, True).layer_bytes_per_token(segmented=True)
    latent = MemoryModel(big, 1, 1, True, latent_kv=True).layer_bytes_per_token(segmented=True)
    assert expanded - latent == 2 * (2 * big.n_kv_heads * big.head_dim - big.latent_kv.cached)

    shape = PRESETS["deepseek-v3-16b"]
    hw = Hardware(gpus=12, memory_gb=80)
    kw = {"pp": (3,), "tp": (1,), "chunks": (4, 16), "schedules": ["1F1B", "Seq1F1B"]}
    short = search(shape, 65536, hw, 12, **kw)
    by_label = {c.setting.label(): c for c in short.candidates}
    expanded_runs = [c for c in short.candidates if c.setting.seq_chunks > 1]
    expanded_runs = [c for c in expanded_runs if not c.setting.latent_kv]
    assert expanded_runs
    for c in expanded_runs:
        assert by_label[c.setting.label() + ", latent K/V"].step_seconds > c.step_seconds
    assert not short.candidates[0].setting.latent_kv  # both fit: the expanded cache is faster
    long = search(shape, 131072, hw, 12, **kw)
    fitting = [c for c in long.candidates if c.fits]
    assert fitting and all(c.setting.latent_kv for c in fitting), [
        c.setting.label() for c in fitting
    ]
    assert "latent K/V re-expanded per segment" in fitting[0].why()
    tomllib = pytest.importorskip("tomllib")
    out = tmp_path / "plan.toml"
    argv = "--model deepseek-v3-16b --seq-len 131072 --gpus 12 --gpu-memory-gb 80 --pp 3 --tp 1"
    assert toml_main([*argv.split(), "--output", str(out)]) == 0
    doc = tomllib.loads(out.read_text())
    assert doc["seq1f1b"]["kv_cache"] == "latent"
    assert (doc["model"]["name"], doc["model"]["flavor"]) == ("deepseek_v3", "16B")


def test_windowed_layers_cache_one_window_of_each_segment() -> None:
    """Under full AC a sliding-window layer's cache of a segment is its last ``window - 1``
    keys (GPT-OSS 120B: 128-key windows on 18 of 36 layers), whatever the segment's length;
    without AC the K/V are among the saved activations either way."""
    windowed = PRESETS["gpt-oss-120b"]
    full = dataclasses.replace(windowed, window=None, window_layers=None)
    kv = 2 * windowed.n_kv_heads * windowed.head_dim * 2  # bf16 K and V a token a layer
    for tokens in (4096, 32768):
        got = [MemoryModel(s, 1, 1, True).unit_bytes(tokens, 36, False, True)
               for s in (windowed, full)]  # fmt: skip
        assert got[1] - got[0] == 18 * (tokens - 127) * kv
        no_ac = [MemoryModel(s, 1, 1, False).unit_bytes(tokens, 36, False, True)
                 for s in (windowed, full)]  # fmt: skip
        assert no_ac[0] == no_ac[1]


#: the paper-7B plan's first rows (``--model paper-7b --seq-len 65536 --gpus 32 --gpu
#: a100-80gb``): what every setting's floats decide, ties and their order included
PAPER_7B_TOP = [
    "pp4 tp2 fsdp4 M=16 Seq1F1B K=16 compute, no AC",
    "pp4 tp2 fsdp4 M=16 Seq1F1B K=8 compute, no AC",
    "pp4 tp2 fsdp4 M=16 ZBSeq1F1B K=8 compute, no AC",
    "pp8 tp1 fsdp4 M=16 Seq1F1B K=16 compute, no AC",
    "pp4 tp2 fsdp4 M=16 InterleavedSeq1F1B v=2 K=4 uniform, no AC",
    "pp4 tp2 fsdp4 M=16 InterleavedSeq1F1B v=2 K=4 compute, no AC",
    "pp1 tp4 fsdp8 M=8 no PP, no AC",
    "pp2 tp4 fsdp4 M=16 InterleavedSeq1F1B v=2 K=4 uniform, no AC",
    "pp2 tp4 fsdp4 M=16 Seq1F1B K=8 compute, no AC",
    "pp4 tp2 fsdp4 M=16 InterleavedSeq1F1B v=2 K=8 uniform, no AC",
    "pp2 tp4 fsdp4 M=16 InterleavedSeq1F1B v=2 K=4 compute, no AC",
    "pp4 tp2 fsdp4 M=16 ZBSeq1F1B K=16 compute, no AC",
]


def test_paper_7b_plan_keeps_its_ranking() -> None:
    """The full paper-7B search (1794 settings, every schedule's order replayed in one batch,
    seq1f1b/planning/batch_simulate.py) ranks as the per-setting simulator does: the same
    first rows, the same settings fitting; its speed is benchmarks/planner_speed.py's. (1848
    before torch's zero-bubble schedules stopped being priced under AC: 54 settings.)"""
    argv = "--model paper-7b --seq-len 65536 --gpus 32 --gpu a100-80gb".split()
    # as scripts/plan.sh searches it: torchtitan 0.3's trainer, the integration's
    _, plan = problem_from_args(build_parser(trainers=TRAINERS).parse_args(argv), TRAINERS)
    assert [c.setting.label() for c in plan.candidates[:12]] == PAPER_7B_TOP
    assert (len(plan.candidates), sum(c.fits for c in plan.candidates)) == (1794, 1377)
    assert f"{plan.candidates[0].step_seconds:.2f}" == "69.39"


def test_batched_replay_prices_as_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every setting priced by the batched replay equals the one priced through
    ``simulate``, which the search falls back to for a replay it does not take: same
    candidates, same order, same floats."""
    kw = dict(pp=[2, 4], tp=[1, 2], chunks=(1, 2, 4), trainer=TORCHTITAN_03)
    batched = search(LLAMA8B, 32768, Hardware(8, 80.0), 16, **kw, selective=True)
    monkeypatch.setattr(search_module, "simulate_graphs", lambda jobs: [None] * len(jobs))
    one_by_one = search(LLAMA8B, 32768, Hardware(8, 80.0), 16, **kw, selective=True)
    assert len(batched.candidates) > 100
    assert [dataclasses.asdict(c) for c in batched.candidates] == [
        dataclasses.asdict(c) for c in one_by_one.candidates
    ]
    assert batched.skipped == one_by_one.skipped
