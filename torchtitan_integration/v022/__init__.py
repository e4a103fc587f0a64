"""Seq1F1B in torchtitan 0.2.2's Llama3 trainer.

``torchtitan_integration.train`` runs :func:`.train.run` on 0.2.2: it installs CPU/gloo support
when there is no GPU (:mod:`.patches`, undone at the end), the offline dataset, and a
``llama3`` train spec (:mod:`.spec`) whose pipelining function (:mod:`.pipeline`) understands
this library's schedule names; the trainer is :mod:`.trainer`. The private torchtitan names
used are in :mod:`._titan`. Importing these modules patches nothing.
"""
