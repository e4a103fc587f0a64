"""torchtitan 0.3 config functions: ``--module torchtitan_integration --config <name>``.

torchtitan's ``ConfigManager`` imports ``<module>.config_registry`` and calls the named
function, which returns a :class:`~torchtitan_integration.v03.trainer.Seq1F1BTrainer.Config`
(``Trainer.Config`` plus the ``seq1f1b`` section). Only importable with torchtitan 0.3.
"""

from __future__ import annotations

from .v03.configs import seq1f1b_debugmodel, seq1f1b_llama3, seq1f1b_model, seq1f1b_qwen3

__all__ = ["seq1f1b_debugmodel", "seq1f1b_llama3", "seq1f1b_model", "seq1f1b_qwen3"]
