"""What the evaluation stages evaluate: the encoders of ``extract.encoders`` and the headline magnification."""

from __future__ import annotations

from cellpath.config import Params
from cellpath.encoders.registry import EncoderSpec, load_registry
from cellpath.errors import ConfigError


def evaluated_encoders(params: Params) -> list[EncoderSpec]:
    """Registry entries of ``extract.encoders`` (names or slugs), in the listed order."""
    registry = load_registry(params.extract.registry)
    by_key = {spec.slug: spec for spec in registry.values()} | registry
    unknown = [e for e in params.extract.encoders if e not in by_key]
    if unknown:
        raise ConfigError(f"extract.encoders: unknown encoder(s) {', '.join(unknown)}; known slugs: "
                          f"{', '.join(sorted(s.slug for s in registry.values()))}")
    return [by_key[e] for e in params.extract.encoders]


def headline_magnification(magnifications: list[str]) -> str:
    """The magnification of the headline numbers and CRT: 20× (the paper's) when evaluated."""
    return "20x" if "20x" in magnifications else magnifications[0]
