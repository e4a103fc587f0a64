"""Compute orders in torch's action IR: Seq1F1B, its zero-bubble and V variants, and the
rules every order obeys (no runtime, no model)."""
