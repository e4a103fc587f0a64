"""Step time against torch's schedules: simulated at the paper's sizes, measured vs
simulated, compiled vs eager, and the attention's own price per segment.
"""
