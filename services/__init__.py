"""Cascadia: resident-weight serving of sparse mixture-of-experts models across a fleet."""

__version__ = "0.1.0"
