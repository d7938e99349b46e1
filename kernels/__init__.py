"""Ops with a torch reference and a Triton implementation behind one dispatch."""
