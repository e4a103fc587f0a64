"""Activation memory: the longest sequence each schedule fits in a budget, the memory-capped
split's memory against speed, what the loss keeps on the last stage, and units in flight per
stage against the formula.
"""
