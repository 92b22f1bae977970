"""docs/encoders.md, the evidence of every registry row, lists each paper model with the row's values."""

from __future__ import annotations

from cellpath.features.encoders.registry import load_registry
from helpers.project import PROJECT_ROOT


def test_the_evidence_table_has_every_paper_model_with_its_rows_values():
    registry = load_registry(PROJECT_ROOT / "models" / "encoders.yaml")
    lines = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[1:-1]]
             for line in (PROJECT_ROOT / "docs" / "encoders.md").read_text().splitlines()
             if line.startswith("| ") and not line.startswith("| model")}
    paper = [spec for spec in registry.values() if spec.type != "control"]
    assert len(paper) == 30 and sorted(lines) == sorted(spec.name for spec in paper)
    for spec in paper:
        name, loader, hub, architecture, geometry, prefix, cls, width, *_ = lines[spec.name]
        assert loader == f"`{spec.loader}`", spec.name
        assert hub == (spec.hub_repo or "—"), spec.name
        built = spec.timm_model or spec.transformers_class or spec.open_clip_model or (
            f"BEiT-3 vision path (depth={spec.beit3_kwargs.depth}" if spec.beit3_kwargs else None)
        assert spec.loader.startswith("custom:") or built in architecture, spec.name
        assert (spec.lora is not None) == (f"+ LoRA (alpha={spec.lora.alpha:g}" in architecture
                                           if spec.lora else "LoRA" in architecture), spec.name
        assert geometry.startswith(f"{spec.input_size}")
        assert geometry.endswith(f"/ {spec.patch_size} / {spec.grid_size}"), spec.name
        assert (int(prefix), cls == "yes", int(width)) == (spec.num_prefix_tokens, spec.has_cls, spec.embed_dim)
