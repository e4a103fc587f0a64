"""Seq1F1B in torchtitan's Llama3 trainer: a shared core plus one folder per torchtitan version.

* Entry points: ``python -m torchtitan_integration.train`` (torchtitan's TRAIN_FILE; what
  ``run_train.sh`` runs) dispatches on the installed torchtitan (:mod:`.versions`, found by
  feature); :mod:`.config` is the TOML ``custom_config_module`` (the ``[seq1f1b]`` section);
  :mod:`.config_registry` serves 0.3's ``--module torchtitan_integration --config NAME``;
  ``python -m torchtitan_integration.planner`` writes a TOML for a cluster;
  ``python -m torchtitan_integration.assets`` builds the offline tokenizer and corpus.
* The core (no torchtitan import): settings checks, split and schedule (:mod:`.pipeline`),
  BitPipe's stages and norm (:mod:`.bitpipe`), the PP loss on every rank and the BitPipe train
  step (:mod:`.common`), the CPU replacements (:mod:`.cpu`), scoped patch lists
  (:mod:`.patches`), the start-up self-check (:mod:`.verify`), the offline assets.
* ``v022/`` (torchtitan 0.2.2: train spec, TOML JobConfig) and ``v03/`` (0.3.0: config
  functions, configurable Trainer), each with the same roles: ``_titan.py`` (the seam: every
  private or patched torchtitan name, with a table), ``patches.py`` (every reassignment, by
  scope), ``model.py`` (chunk-aware attention), ``pipeline.py`` (the pipelining function),
  ``validate.py`` (start-up checks), ``trainer.py``, ``train.py`` (the run).

Importing any of these modules patches nothing.
"""

from seq1f1b.registry import schedule_names

SCHEDULE_NAMES = tuple(schedule_names(ours=True))  # the names this integration adds
