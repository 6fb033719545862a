"""The package version, in a module of its own so the host can name it without the guest."""

__version__ = "0.1.0"
