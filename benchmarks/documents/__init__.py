"""Packed documents: skipping blocks no document sees (measured) and the mask-aware split
(simulated, on synthetic and shipped real documents).
"""
