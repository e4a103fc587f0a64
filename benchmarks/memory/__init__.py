"""Activation memory: the longest sequence each schedule fits in a budget, the memory-capped
split's memory against speed, and what the loss keeps on the last stage.
"""
