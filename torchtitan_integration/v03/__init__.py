"""Seq1F1B in torchtitan 0.3.0: a ``Trainer`` subclass with a ``seq1f1b`` config section.

Entry points (all build :class:`.trainer.Seq1F1BTrainer`):

* torchtitan's own: ``python -m torchtitan.train --module torchtitan_integration --config
  seq1f1b_debugmodel --seq1f1b.seq_chunks 4`` (config functions in
  ``torchtitan_integration/config_registry.py``), or its ``MODULE=... CONFIG=... run_train.sh``;
* ours: ``CONFIG_FILE=x.toml ./run_train.sh``, a 0.2.2-style TOML mapped onto 0.3's config
  (:mod:`.toml`).

Importing these modules patches nothing; the trainer installs CPU/gloo support for its own
lifetime when there is no GPU (:mod:`.patches`, every reassignment by scope). The private
torchtitan names used are in :mod:`._titan`.
"""
