"""Cascadia: resident-weight serving of sparse mixture-of-experts models across a fleet.

The package spans two source roots, `services/` and `operator/` (which holds `cascadia.operator`):
with both on the import path, as a checkout's tools set them, this package finds its operator there.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
__version__ = "0.1.0"
