"""Benchmarks of seq1f1b, one folder per thing measured (not installed with the package).

``python -m benchmarks`` runs the whole comparison (:mod:`benchmarks.run`) and sums it up in
headline ratios (:mod:`benchmarks.headline`); each folder's modules with a ``main`` also run
alone (``python -m benchmarks.<folder>.<module>``):

* ``step_time/``: step time against torch's schedules (simulated at the paper's sizes, measured
  vs simulated, compiled vs eager, attention's price per segment);
* ``memory/``: activation memory (longest sequence in a budget, the memory-capped split, the
  loss on the last stage, units in flight against the formula);
* ``documents/``: packed documents (block skipping, the mask-aware split);
* ``cp/``: context parallelism with Seq1F1B, and torch's own ring on CPU;
* ``scale/``: schedule build time up to pp=64;
* ``planner_models/``: the planner's time and memory models against measurements;
* ``harness/``: how everything above measures (ranks, probes, replay, orders, sizes);
* ``output/``: tables, pictures and traces of a run.

Why by subject: a reader looking for "how was memory measured" finds one folder, and the
shared harness sits below the subjects that use it. No module or folder here is named like one
in ``seq1f1b/`` (tests/test_benchmarks_layout.py checks), so a traceback or an import never
leaves it unclear which ``calibration`` or ``masks`` is meant. The goals the numbers are held to
live in docs/benchmarks.md's "Targets" table, not here: the code reports measurements and ratios.
"""
