"""Deprecated path of :mod:`sp_attention.planning.packing`
(works for one release; see the changelog in the top README.md)."""
from ._deprecated import moved

moved(__name__, "sp_attention.planning.packing")
