"""Context parallelism: Seq1F1B with the CP ring (memory, traffic, longest sequence) and whether
torch's own ring runs on CPU.
"""
