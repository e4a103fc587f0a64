"""Llama 3 (``torchtitan.models.llama3``): GQA attention and SwiGLU FFNs; nothing to adapt."""

from __future__ import annotations

from .base import ModelFamily

FAMILY = ModelFamily(name="llama3")
