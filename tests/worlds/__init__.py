"""Helpers that start real programs for any tier, so that no tier imports another's tests."""
