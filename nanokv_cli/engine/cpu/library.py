"""The kernels' shared library as this process loaded it, its functions typed from the
contract table (``contract.py``): what ``kernels.py`` and ``program.py`` call."""

from __future__ import annotations

import ctypes
from functools import cache

from . import build, contract

# ctypes (argtypes, restype) of every entry point: derived from the table, never written twice.
SIGNATURES = contract.signatures()


def status() -> build.Kernels:
    """How the kernels load here: the variant, the library file, or why they are unavailable
    (``missing``: what, what it costs, how to fix it). Asked afresh (cheap once built); the
    layers use the answer ``library`` kept."""
    return build.kernels(tuple(SIGNATURES))


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions typed, or None (switched off, no compiler: the
    torch paths serve)."""
    lib = status().lib
    if lib is None:
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib
