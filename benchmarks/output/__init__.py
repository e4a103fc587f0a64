"""What a run writes: the markdown tables, the timeline pictures and the Chrome traces.

Why apart: presenting results neither runs nor measures anything.
"""
