"""integrations: what a PyTorch user touches (flat parameters, wrappers)."""

from .flat import FlatParams

__all__ = ["FlatParams"]
