"""How a measurement is taken: gloo ranks running the schedules, the per-action probe and
saved-activation meter, the CPU-time replay, the real pipeline orders, and the sizes of each mode.

Why apart: every part below measures through the same harness, so the definitions of a step
time and of a memory peak are the same everywhere.
"""
