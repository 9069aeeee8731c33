"""The version of cupaged, in one place (pyproject.toml reads it statically)."""

__version__ = "0.1.0"
