"""Data pipeline (being split into modules)."""

from .sources import *  # noqa: F403
from .sources import __all__  # noqa: F401
