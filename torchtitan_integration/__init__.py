"""Seq1F1B in torchtitan 0.2.2's Llama3 trainer.

Run through the train entry ``python -m torchtitan_integration.train --job.config_file X.toml``
(what ``run_train.sh`` does). Importing :mod:`torchtitan_integration.train` installs, in order:
CPU/gloo support when there is no GPU (:mod:`.cpu`), the offline dataset (:mod:`.assets`), and
a ``llama3`` train spec whose pipelining function understands the ``Seq1F1B`` and
``InterleavedSeq1F1B`` schedule names (:mod:`.spec`, :mod:`.pipeline`).
"""

from seq1f1b.registry import schedule_names

SCHEDULE_NAMES = tuple(schedule_names(ours=True))  # the names this integration adds
