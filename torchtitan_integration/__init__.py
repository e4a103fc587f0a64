"""Seq1F1B in torchtitan 0.2.2's Llama3 trainer.

Run through the train entry ``python -m torchtitan_integration.train --job.config_file X.toml``
(what ``run_train.sh`` does). Its ``run()`` installs, for the run: CPU/gloo support when there is
no GPU (:mod:`.cpu`, undone at the end), the offline dataset (:mod:`.assets`), and a ``llama3``
train spec whose pipelining function understands this library's schedule names from
:mod:`seq1f1b.registry` (:mod:`.spec`, :mod:`.pipeline`); the trainer is :mod:`.trainer`.
Importing any of these modules patches nothing.
"""

from seq1f1b.registry import schedule_names

SCHEDULE_NAMES = tuple(schedule_names(ours=True))  # the names this integration adds
