"""The version, in a leaf module: modules that print it import nothing else of nanokv."""

__version__ = "0.1.0"
