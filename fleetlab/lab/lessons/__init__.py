"""Teaching variants of engine pieces: what the runtime could do instead, and why it doesn't.

They use only the runtime pieces' public methods, so they stay honest comparisons.
"""
