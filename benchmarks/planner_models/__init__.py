"""The planner's models against measurements: the time model fitted on measured actions, and
the memory model against the paper's published table.
"""
