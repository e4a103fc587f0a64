"""The FLOPs-model shape of the benchmarks' test model (what the compute split prices).

Apart from :mod:`.measured` so that a benchmark importing only the library's public API (and
so runnable against an older checkout's ``seq1f1b``) can price its split the same way.
"""

from __future__ import annotations

from seq1f1b import ModelShape
from seq1f1b.testing import TinyConfig

__all__ = ["model_shape"]


def model_shape(cfg: TinyConfig) -> ModelShape:
    """FLOPs-model shape of a TinyConfig; SwiGLU's three matrices count as a 1.5x wider FFN."""
    return ModelShape(
        hidden=cfg.dim,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        vocab=cfg.vocab,
        ffn_hidden=3 * cfg.ffn // 2,
    )
