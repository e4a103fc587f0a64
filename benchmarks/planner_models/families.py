"""Every model family at its real size, simulated: Seq1F1B's step against 1F1B's, and what
the latent K/V cache of multi-head latent attention costs and saves.

    python -m benchmarks.planner_models.families [--gpu h100-80gb] [--json FILE]

Table 1: for each preset (Llama3 8B beside Qwen3 32B, Qwen3-30B-A3B, DeepSeek-V3 671B,
GPT-OSS 120B and the hybrid Qwen3.5 27B, whose Gated DeltaNet layers are priced linear in
the length with a state per sample; its MoE flavors need expert parallelism, which the
planner does not price), pp = 4 and 8, 32k and 128k tokens, the planner's best fitting 1F1B and best
fitting Seq1F1B-family setting (any K, split, AC, TP, FSDP) on the GPU profile: predicted
tokens/s per GPU and their ratio. Mixtures of experts are priced by active FLOPs, weights by
all experts. The planner prices equal stages only: DeepSeek-V3 671B's 61 layers, which no
pipeline degree of 4 or 8 divides, are priced as 64 (marked), and GPT-OSS 120B's 36 run at
pp = 4 only.

Table 2: the latent K/V cache at DeepSeek-V3 671B: cached values a token a layer both ways,
and the re-expansion's share of the step (the same setting priced with and without it) at
64k and 128k; TP = 1 as the latent cache runs (the step need not fit for this ratio).

Table 3: Qwen3.5 397B-A17B's hybrid stack (45 Gated DeltaNet layers, 15 with attention),
per unit of one sample on the whole model: the K/V cache a later segment reads of it (its
attention layers, bf16) beside the state its Gated DeltaNet layers carry to the next segment
(fp32 delta-rule state and bf16 convolution tail), for K = 1..16 at 32k and 128k. The state
does not depend on the segment length.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from seq1f1b.planning.costmodel import PRESETS
from seq1f1b.planning.planner import search
from seq1f1b.planning.profiles import PROFILES, profile

__all__ = ["hybrid_rows", "latent_rows", "main", "model_rows"]

MODELS = ("llama3-8b", "qwen3-32b", "qwen3-30b-a3b", "deepseek-v3-671b", "gpt-oss-120b",
          "qwen3.5-27b")  # fmt: skip
GPUS = {"deepseek-v3-671b": 256}  # the rest: 64
SEQ_LENS = (32768, 131072)
PIPELINES = (4, 8)
SEQ1F1B_FAMILY = ("Seq1F1B", "InterleavedSeq1F1B", "ZBSeq1F1B", "ZBVSeq1F1B")


def _shape(name: str):
    shape = PRESETS[name]
    return replace(shape, n_layers=64) if shape.n_layers == 61 else shape


def model_rows(gpu: str = "h100-80gb") -> list[dict]:
    """Table 1 (module docstring): one row per model, pipeline degree and length."""
    prof = profile(gpu)
    rows = []
    for name in MODELS:
        shape, gpus = _shape(name), GPUS.get(name, 64)
        hw, actions = prof.hardware(gpus), prof.action_costs()
        for pp in PIPELINES:
            if shape.n_layers % pp:
                continue  # equal stages only (GPT-OSS 120B's 36 layers: pp = 4)
            for seq_len in SEQ_LENS:
                plan = search(shape, seq_len, hw, gpus, pp=(pp,), actions=actions,
                              schedules=["1F1B", *SEQ1F1B_FAMILY], chunks=(4, 8),
                              splits=("compute",))  # fmt: skip
                fitting = [c for c in plan.candidates if c.fits]
                base = next((c for c in fitting if c.setting.seq_chunks == 1), None)  # 1F1B
                ours = next((c for c in fitting if c.setting.seq_chunks > 1), None)
                rows.append({
                    "model": name + (" (64 layers)" if PRESETS[name].n_layers == 61 else ""),
                    "pp": pp, "seq_len": seq_len, "gpus": gpus,
                    "1F1B": base.setting.label() if base else None,
                    "seq1f1b": ours.setting.label() if ours else None,
                    "1F1B_tps": base.tokens_per_second_per_gpu if base else None,
                    "seq1f1b_tps": ours.tokens_per_second_per_gpu if ours else None,
                    "ratio": (ours.tokens_per_second_per_gpu / base.tokens_per_second_per_gpu
                              if base and ours else None),
                })  # fmt: skip
    return rows


def latent_rows(gpu: str = "h100-80gb") -> list[dict]:
    """Table 2 (module docstring)."""
    shape = _shape("deepseek-v3-671b")
    latent = shape.latent_kv
    assert latent is not None
    prof = profile(gpu)
    rows = []
    for seq_len in (65536, 131072):
        plan = search(shape, seq_len, prof.hardware(256), 256, pp=(8,), tp=(1,), chunks=(8,),
                      schedules=["Seq1F1B"], actions=prof.action_costs(), splits=("compute",),
                      recompute=(True,))  # fmt: skip
        by = {c.setting.latent_kv: c for c in plan.candidates}
        rows.append({
            "seq_len": seq_len, "setting": by[False].setting.label(),
            "expanded_values": 2 * shape.n_kv_heads * shape.head_dim,
            "latent_values": latent.cached,
            "reexpansion_share": 1 - by[False].step_seconds / by[True].step_seconds,
            "activation_peak_ratio": by[True].max_bytes / by[False].max_bytes,
        })  # fmt: skip
    return rows


def hybrid_rows(name: str = "qwen3.5-397b-a17b") -> list[dict]:
    """Table 3 (module docstring)."""
    shape = PRESETS[name]
    la = shape.linear_attention
    assert la is not None
    kv_per_token = shape.softmax_layers * 2 * 2 * shape.n_kv_heads * shape.head_dim  # bf16
    return [
        {"seq_len": seq_len, "seq_chunks": k, "segment": seq_len // k,
         "kv_bytes": kv_per_token * seq_len // k, "state_bytes": la.layers * la.state_bytes(2)}
        for seq_len in SEQ_LENS
        for k in (1, 2, 4, 8, 16)
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner_models.families",
                                 description=__doc__)  # fmt: skip
    ap.add_argument("--gpu", default="h100-80gb", choices=sorted(PROFILES))
    ap.add_argument("--json", type=Path, help="write both tables here too")
    a = ap.parse_args(argv)
    models, latent, hybrid = model_rows(a.gpu), latent_rows(a.gpu), hybrid_rows()
    print("| model | GPUs | pp | seq | 1F1B tok/s/GPU | Seq1F1B family tok/s/GPU | ratio | "
          "Seq1F1B setting |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in models:
        tps = [f"{r[k]:.0f}" if r[k] else "none fits" for k in ("1F1B_tps", "seq1f1b_tps")]
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"| {r['model']} | {r['gpus']} | {r['pp']} | {r['seq_len'] // 1024}k | {tps[0]} | "
              f"{tps[1]} | {ratio} | {r['seq1f1b'] or '-'} |")  # fmt: skip
    print("\n| DeepSeek-V3 671B, pp8 tp1 | cached values a token a layer | re-expansion share "
          "of the step | peak memory, latent / expanded |\n|---|---|---|---|")  # fmt: skip
    for r in latent:
        print(f"| {r['seq_len'] // 1024}k, {r['setting']} | {r['latent_values']} vs "
              f"{r['expanded_values']} (1/{r['expanded_values'] / r['latent_values']:.0f}) | "
              f"{r['reexpansion_share']:.1%} | {r['activation_peak_ratio']:.2f} |")  # fmt: skip
    print(
        "\n| Qwen3.5 397B-A17B, one sample | K | segment | K/V cache of a unit (15 attention "
        "layers) | state a unit carries (45 Gated DeltaNet layers) |\n|---|---|---|---|---|"
    )
    for r in hybrid:
        print(
            f"| {r['seq_len'] // 1024}k | {r['seq_chunks']} | {r['segment']} | "
            f"{r['kv_bytes'] / 2**20:.0f} MiB | {r['state_bytes'] / 2**20:.0f} MiB |"
        )
    if a.json:
        a.json.write_text(json.dumps({"models": models, "latent": latent, "hybrid": hybrid},
                                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
