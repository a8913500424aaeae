"""Decentralized and compressed-communication algorithms, one module each.

Each module holds its State NamedTuple, pure `init`/`step` functions and an
optax factory of the module's name; `lpdec/__init__.py` re-exports the
factories (this package does not, so `lpdec.algorithms.choco` stays the module).
"""
