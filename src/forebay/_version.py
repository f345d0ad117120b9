"""The version of forebay (a leaf module: every package may import it)."""

__version__ = "0.1.0"
