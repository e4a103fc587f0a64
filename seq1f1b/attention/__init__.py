"""Segment-aware attention: K/V state across segments, mask tile plans for documents,
windows and sinks, the kernels, the context-parallel ring, and the position-mixing guard."""
