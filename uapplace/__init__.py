"""uapplace: operator-directed placement of local AI model backends."""

__version__ = "0.1.0"
