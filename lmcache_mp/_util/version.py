"""The package's version, in one place."""

__all__ = ["__version__"]

__version__ = "0.1.0"
