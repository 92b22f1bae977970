"""Frozen patch encoders: the registry of models (``models/encoders.yaml``) and their loading."""

from cellpath.features.encoders.registry import EncoderSpec, RegistryError, load_registry

__all__ = ["EncoderSpec", "RegistryError", "load_registry"]
