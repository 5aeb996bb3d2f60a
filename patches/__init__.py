"""Integration with transformers' own classes (installed as ``paged_transformers.patches``)."""

from .generate import PatchHandle, is_patched, patch, unpatch

__all__ = ["PatchHandle", "is_patched", "patch", "unpatch"]
