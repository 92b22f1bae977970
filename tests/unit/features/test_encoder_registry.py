"""The encoder registry (models/encoders.yaml) and loading encoders offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import csv  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from cellpath.features.encoders.loading import (TIMM_LAYERS, EncoderLoadError, EncoderUnavailable,  # noqa: E402
                                                build_timm_module, check_module, images_to_tensor, load_encoder,
                                                split_tokens)
from cellpath.features.encoders.registry import (TIMM_LAYER_NAMES, EncoderSpec, RegistryError,  # noqa: E402
                                                 load_registry, model_slug)
from helpers.hub_cache import COMMIT, hub_snapshot
from helpers.project import PROJECT_ROOT  # noqa: E402

REGISTRY_PATH = PROJECT_ROOT / "models" / "encoders.yaml"
MODELS_CSV = PROJECT_ROOT / "models" / "foundation_models.csv"  # Table 6, transcribed

# The `model` column of foundation_models.csv (the paper's Table 6).
PAPER_MODELS = [
    "H-Optimus-1", "H-Optimus-0", "Prov-GigaPath", "Virchow2", "Virchow", "UNI2", "GPFM", "Hibou-L", "UNI",
    "Phikon-v2", "Kaiko ViT-L/14", "Hibou-B", "Kaiko ViT-B/8", "Kaiko ViT-B/16", "H0-mini", "Phikon",
    "CTransPath (CHIEF)", "Kaiko ViT-S/8", "Kaiko ViT-S/16", "Lunit ViT-S/8", "MUSK", "CONCH v1.5", "mSTAR",
    "CONCH", "PLIP", "SEAL (UNI2)", "OmiCLIP", "SEAL (CONCH)", "DINOv3 ViT-L/16", "DINOv3 ViT-B/16",
]
OFFLINE_MODELS = ["random-vit-s16", "random-vit-t16", "filterbank-dense"]


@pytest.fixture(scope="module")
def registry() -> dict[str, EncoderSpec]:
    return load_registry(REGISTRY_PATH)


def tiny_spec(**overrides) -> EncoderSpec:
    """A 1-block ViT on 32 px inputs with 8 px tokens (4×4 grid); timm, weights from a file."""
    row = {
        "name": "tiny-vit", "type": "control", "architecture": "ViT-tiny/8",
        "hub_id": "hf-hub:cellpath-test/tiny-vit", "revision": "main", "loader": "timm",
        "timm_model": "vit_small_patch16_224",
        "timm_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 0},
        "mean": [0.6, 0.5, 0.4], "std": [0.2, 0.25, 0.3], "input_size": 32, "patch_size": 8,
        "num_prefix_tokens": 1, "has_cls": True, "embed_dim": 32, "native_mpp": None,
        "pretrain_magnification": None, "precision": "fp32", "params": None, "pretrain_wsi_equivalent": None,
    }
    row.update(overrides)
    return EncoderSpec.model_validate(row)


def random_images(n: int = 2, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def reference_tokens(module: torch.nn.Module, spec: EncoderSpec, images: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return module.eval().forward_features(images_to_tensor(images, spec, torch.device("cpu")))


# ------------------------------------------------------------------ the registry file


def test_registry_lists_the_30_paper_models_and_the_offline_controls(registry):
    assert list(registry) == OFFLINE_MODELS + PAPER_MODELS
    assert len({spec.slug for spec in registry.values()}) == 33


def test_registry_rows_copy_the_reference_csv(registry):
    with MODELS_CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["model"] for row in rows] == PAPER_MODELS
    for row in rows:
        spec = registry[row["model"]]
        assert spec.type == row["type"]
        assert spec.architecture == row["architecture"]
        assert (spec.paper_input_size or spec.input_size) == int(row["input_size"])  # departures say so
        assert spec.params == row["params"]
        assert spec.pretrain_wsi_equivalent == (row["pretrain_wsi_equivalent"] or None)
        assert spec.pretrain_magnification == (row["pretrain_magnification"] or None)


# Rows whose model card resizes a larger tile to the encoder input: native_mpp is the tile's µm over the
# input px. GPFM's README: 512 px "extracted from 40X", resized to 224. CONCH v1.5 as TRIDENT runs it
# (conch_v15 --patch_size 512 --mag 20, resized to 448). CTransPath (CHIEF) as TRIDENT runs it
# (ctranspath --patch_size 256 --mag 10, resized to 224).
RESIZED_BY_THE_CARD = {"GPFM": 512 * 0.25 / 224, "CONCH v1.5": 512 * 0.5 / 448, "CTransPath (CHIEF)": 256 * 1.0 / 224}


def test_native_mpp_is_the_finest_pretraining_magnification_or_the_cards_resized_tile(registry):
    mpp_of = {"20x": 0.5, "10x": 1.0, "(5,10,20,40)x": 0.25, "(10,20,40)x": 0.25, "20x, 40x": 0.25,
              "Unknown": None, None: None}
    for spec in registry.values():
        if spec.name in RESIZED_BY_THE_CARD:
            assert spec.native_mpp == pytest.approx(RESIZED_BY_THE_CARD[spec.name], rel=1e-6), spec.name
        else:
            assert spec.native_mpp == mpp_of[spec.pretrain_magnification], spec.name
    assert registry["GPFM"].native_mpp == pytest.approx(128 / 224, rel=1e-6)  # a 128 µm tile as 224 px
    assert registry["CTransPath (CHIEF)"].native_mpp == pytest.approx(8 / 7, rel=1e-6)  # 256 µm as 224 px
    conch15 = registry["CONCH v1.5"]  # read at 20x (0.5 µm/px), its input covers the card's 256 µm tile
    assert conch15.input_size * 0.5 == pytest.approx(conch15.native_mpp * 448, rel=1e-6) == 256


def test_cls_less_encoders(registry):
    assert registry["CTransPath (CHIEF)"].has_cls is False
    assert registry["filterbank-dense"].has_cls is False
    assert {name for name, spec in registry.items() if not spec.has_cls} == {"CTransPath (CHIEF)", "filterbank-dense"}


def test_registered_timm_architectures_match_their_rows(registry):
    """Each timm row, built on the meta device with one block (fast; depth changes neither the
    prefix nor the grid), has the row's prefix tokens, width and token grid."""
    for spec in registry.values():
        if spec.timm_model is not None:
            shallow = spec.model_copy(update={"timm_kwargs": spec.timm_kwargs | {"depth": 1}})
            with torch.device("meta"):
                module = build_timm_module(shallow)
                check_module(spec, module)
                tokens = module.forward_features(torch.zeros(1, 3, spec.input_size, spec.input_size))
            split_tokens(spec, tokens)


def test_loader_resolves_every_layer_name_the_registry_allows():
    assert set(TIMM_LAYERS) == set(TIMM_LAYER_NAMES)


def test_slug():
    assert model_slug("Kaiko ViT-L/14") == "kaiko-vit-l-14"
    assert model_slug("CTransPath (CHIEF)") == "ctranspath-chief"


def _write_registry(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "encoders.yaml"
    path.write_text(yaml.safe_dump({"notes": "test", "encoders": rows}))
    return path


def _row(name: str) -> dict:
    document = yaml.safe_load(REGISTRY_PATH.read_text())
    return next(row for row in document["encoders"] if row["name"] == name)


def test_unknown_key_is_an_error_naming_model_and_key(tmp_path):
    path = _write_registry(tmp_path, [_row("UNI") | {"patchsize": 16}])
    with pytest.raises(RegistryError, match=r"encoder 'UNI': key 'patchsize': unknown key"):
        load_registry(path)


@pytest.mark.parametrize(("change", "message"), [
    ({"patch_size": 15}, "not a multiple of patch_size"),
    ({"num_prefix_tokens": 0}, "has_cls is true"),
    ({"timm_kwargs": {"img_size": 256}}, "timm_kwargs.img_size"),
    ({"timm_kwargs": {"mlp_layer": "FancyMlp"}}, "timm_kwargs.mlp_layer"),
    ({"precision": "fp8"}, "key 'precision'"),
    ({"hub_id": "MahmoodLab/UNI"}, "key 'hub_id'"),
])
def test_invalid_row_is_an_error_naming_the_model(tmp_path, change, message):
    path = _write_registry(tmp_path, [_row("UNI") | change])
    with pytest.raises(RegistryError, match=r"encoder 'UNI'") as caught:
        load_registry(path)
    assert message in str(caught.value)


def test_missing_key_and_duplicate_name(tmp_path):
    row = _row("UNI")
    del row["embed_dim"]
    with pytest.raises(RegistryError, match=r"encoder 'UNI': key 'embed_dim': Field required"):
        load_registry(_write_registry(tmp_path, [row]))
    with pytest.raises(RegistryError, match="duplicates 'UNI'"):
        load_registry(_write_registry(tmp_path, [_row("UNI"), _row("UNI")]))


def test_missing_registry_file_names_the_path(tmp_path):
    with pytest.raises(RegistryError, match="nowhere.yaml"):
        load_registry(tmp_path / "nowhere.yaml")


# ------------------------------------------------------------------ loading weights


@pytest.mark.parametrize("filename", ["model.safetensors", "pytorch_model.bin"])
def test_local_checkpoint_loads_strictly_and_reproduces_the_module(tmp_path, filename):
    spec = tiny_spec()
    torch.manual_seed(1)
    original = build_timm_module(spec)
    folder = tmp_path / "models" / spec.slug
    folder.mkdir(parents=True)
    if filename.endswith(".safetensors"):
        save_file(original.state_dict(), folder / filename)
    else:
        torch.save(original.state_dict(), folder / filename)

    encoder = load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    images = random_images()
    cls, grid = encoder.forward_tokens(images)
    expected = reference_tokens(original, spec, images)
    assert cls.shape == (2, 32) and grid.shape == (2, 4, 4, 32)
    torch.testing.assert_close(cls, expected[:, 0])
    torch.testing.assert_close(grid, expected[:, 1:].reshape(2, 4, 4, 32))
    assert encoder.revision == "sha256:" + hashlib.sha256((folder / filename).read_bytes()).hexdigest()
    assert not any(p.requires_grad for p in encoder.module.parameters())


def test_checkpoint_of_another_architecture_names_model_and_keys(tmp_path):
    spec = tiny_spec()
    deeper = build_timm_module(tiny_spec(timm_kwargs=spec.timm_kwargs | {"depth": 2}))
    folder = tmp_path / "models" / spec.slug
    folder.mkdir(parents=True)
    save_file(deeper.state_dict(), folder / "model.safetensors")
    with pytest.raises(EncoderLoadError, match=r"tiny-vit: checkpoint .* unexpected: blocks\.1\."):
        load_encoder(spec, weights_dir=tmp_path / "models")


def test_missing_weights_give_one_message_naming_model_and_places(tmp_path):
    spec = tiny_spec()
    with pytest.raises(EncoderUnavailable) as caught:
        load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    message = str(caught.value)
    assert message.startswith("tiny-vit: no weights found")
    for needle in (str(tmp_path / "models" / "tiny-vit"), str(tmp_path / "hf"), "cellpath-test/tiny-vit@main",
                   "hf download cellpath-test/tiny-vit --revision main", "model.safetensors"):
        assert needle in message


def test_a_private_model_without_a_hub_id_loads_from_its_folder_and_says_where_it_looked(tmp_path):
    """A model that exists only on the user's disk: no hub_id, weights in models/<slug>/; without them
    one message names that folder and says there is nowhere else to look."""
    spec = tiny_spec(name="my-vit", hub_id=None)
    with pytest.raises(EncoderUnavailable, match=r"my-vit: no weights found\. Looked for model.safetensors or .* in "
                                                 rf"{re.escape(str(tmp_path / 'models' / 'my-vit'))}/ \(the row has no "
                                                 r"hub_id, so nowhere else\); copy a timm vit_small_patch16_224"):
        load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    torch.manual_seed(2)
    original = build_timm_module(spec)
    (tmp_path / "models" / "my-vit").mkdir(parents=True)
    save_file(original.state_dict(), tmp_path / "models" / "my-vit" / "model.safetensors")
    encoder = load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    images = random_images()
    cls, _ = encoder.forward_tokens(images)
    torch.testing.assert_close(cls, reference_tokens(original, spec, images)[:, 0])


def _fake_hub_snapshot(cache: Path, spec: EncoderSpec, state: dict, config: dict) -> Path:
    snapshot = hub_snapshot(cache, spec.hub_repo)
    save_file(state, snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def test_weights_from_the_hf_cache_record_the_snapshot_commit(tmp_path):
    spec = tiny_spec()
    original = build_timm_module(spec)
    _fake_hub_snapshot(tmp_path / "hf", spec, original.state_dict(), {
        "architecture": "vit_small_patch16_224", "model_args": {"embed_dim": 32, "depth": 1},
        "pretrained_cfg": {"mean": [0.6, 0.5, 0.4], "std": [0.2, 0.25, 0.3]}})
    encoder = load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    assert encoder.revision == COMMIT
    images = random_images()
    torch.testing.assert_close(encoder.forward_tokens(images)[1].reshape(2, 16, 32),
                               reference_tokens(original, spec, images)[:, 1:])


def test_a_hub_config_disagreeing_with_the_row_warns_and_weights_that_do_not_fit_are_an_error(tmp_path, caplog):
    """A port's config.json may carry other values than the card while its weights are right: each
    disagreement is a warning printing both values, and the row's values are used. Whether the weights
    fit the architecture is the strict load's to decide: an error."""
    spec = tiny_spec()
    original = build_timm_module(spec)
    _fake_hub_snapshot(tmp_path / "hf", spec, original.state_dict(), {
        "architecture": "vit_small_patch16_224", "model_args": {"depth": 3},
        "pretrained_cfg": {"mean": [0.485, 0.456, 0.406]}})
    with caplog.at_level("WARNING", logger="cellpath.features.encoders.loading"):
        encoder = load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")
    assert len(encoder.warnings) == 2
    assert re.search(r"tiny-vit: the hub config .*config\.json disagrees .*model_args\.depth 3 vs timm_kwargs\.depth 1",
                     encoder.warnings[0])
    assert re.search(r"pretrained_cfg\.mean \[0\.485, 0\.456, 0\.406\] vs mean \[0\.6, 0\.5, 0\.4\].*"
                     r"mean_std_source: model-card", encoder.warnings[1])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == list(encoder.warnings)
    images = random_images()
    torch.testing.assert_close(encoder.forward_tokens(images)[1].reshape(2, 16, 32),
                               reference_tokens(original, spec, images)[:, 1:])  # the row's mean/std
    deeper = tiny_spec(timm_kwargs={**spec.timm_kwargs, "depth": 3})
    _fake_hub_snapshot(tmp_path / "hf-deeper", spec, build_timm_module(deeper).state_dict(), {
        "architecture": "vit_small_patch16_224", "model_args": {"depth": 3}})
    with pytest.raises(EncoderLoadError, match=r"does not match .*unexpected.*blocks\.1\..*depth"):
        load_encoder(spec, weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf-deeper")


def test_custom_loader_is_unavailable_with_what_it_needs():
    spec = tiny_spec(loader="custom:needs-code", timm_model=None, timm_kwargs={},
                     requires="the needs-code package, not on PyPI")
    expected = r"tiny-vit: cellpath has no loader for 'custom:needs-code'.*not on PyPI"
    with pytest.raises(EncoderUnavailable, match=expected):
        load_encoder(spec)


def test_no_paper_model_needs_a_custom_loader(registry):
    assert [spec.name for spec in registry.values() if spec.loader.startswith("custom:")] == []


def test_paper_model_without_weights_is_unavailable(registry, tmp_path):
    with pytest.raises(EncoderUnavailable, match=r"^UNI: no weights found.*MahmoodLab/UNI@main"):
        load_encoder(registry["UNI"], weights_dir=tmp_path / "models", hf_cache_dir=tmp_path / "hf")


# ------------------------------------------------------------------ token layout


@pytest.mark.parametrize(("extra_kwargs", "prefix", "has_cls"), [
    ({"class_token": False, "global_pool": "avg"}, 0, False),
    ({}, 1, True),
    ({"reg_tokens": 4, "no_embed_class": True}, 5, True),
])
def test_prefix_tokens_are_stripped(extra_kwargs, prefix, has_cls):
    spec = tiny_spec(loader="offline:random-vit", init_seed=3, num_prefix_tokens=prefix, has_cls=has_cls,
                     timm_kwargs=tiny_spec().timm_kwargs | extra_kwargs)
    encoder = load_encoder(spec)
    images = random_images(3)
    cls, grid = encoder.forward_tokens(images)
    tokens = reference_tokens(encoder.module, spec, images)
    assert tokens.shape == (3, prefix + 16, 32)
    assert grid.shape == (3, 4, 4, 32)
    torch.testing.assert_close(grid, tokens[:, prefix:].reshape(3, 4, 4, 32))
    # grid (row i, column j) is the token of input rows [8i, 8i+8) and columns [8j, 8j+8)
    torch.testing.assert_close(grid[:, 1, 2], tokens[:, prefix + 1 * 4 + 2])
    if has_cls:
        torch.testing.assert_close(cls, tokens[:, 0])
    else:
        assert cls is None


def test_prefix_count_disagreeing_with_the_module_is_an_error():
    spec = tiny_spec(loader="offline:random-vit", init_seed=3, num_prefix_tokens=1,
                     timm_kwargs=tiny_spec().timm_kwargs | {"reg_tokens": 4})
    with pytest.raises(EncoderLoadError, match="tiny-vit: the built module has num_prefix_tokens = 5"):
        load_encoder(spec)


def test_token_grid_of_the_wrong_size_is_an_error_naming_the_model():
    spec = tiny_spec()
    with pytest.raises(EncoderLoadError, match=r"tiny-vit: .*1 prefix \+ 4×4 grid"):
        split_tokens(spec, torch.zeros(2, 1 + 9, 32))


def test_images_must_be_channels_last_at_the_input_size():
    spec = tiny_spec()
    with pytest.raises(ValueError, match=r"tiny-vit: expected images of shape \(B, 32, 32, 3\)"):
        images_to_tensor(np.zeros((2, 3, 32, 32), np.uint8), spec, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        images_to_tensor(np.full((1, 32, 32, 3), 255.0), spec, torch.device("cpu"))
    as_uint8 = images_to_tensor(np.full((1, 32, 32, 3), 153, np.uint8), spec, torch.device("cpu"))
    as_float = images_to_tensor(np.full((1, 32, 32, 3), 0.6, np.float32), spec, torch.device("cpu"))
    torch.testing.assert_close(as_uint8, as_float)
    torch.testing.assert_close(as_uint8[0, :, 0, 0], torch.tensor([0.0, 0.4, 2 / 3]))


# ------------------------------------------------------------------ offline encoders


def test_random_init_is_seeded_and_leaves_the_global_rng_alone():
    spec = tiny_spec(loader="offline:random-vit", init_seed=7)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = load_encoder(spec)
    assert torch.equal(torch.rand(1), expected_next)
    second = load_encoder(spec)
    other_seed = load_encoder(tiny_spec(loader="offline:random-vit", init_seed=8))
    weights = [e.module.state_dict()["blocks.0.attn.qkv.weight"] for e in (first, second, other_seed)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert first.revision.startswith("init_seed=7;torch=")


def test_filterbank_shapes(registry):
    cls, grid = load_encoder(registry["filterbank-dense"]).forward_tokens(random_images(1, 224, seed=5))
    assert cls is None
    assert grid.shape == (1, 14, 14, 150) and grid.dtype == torch.float32
    assert torch.isfinite(grid).all()


@pytest.fixture(scope="module")
def small_filterbank(registry):
    """filterbank-dense on 64 px inputs (4×4 tokens): the same filters, a sixteenth of the work."""
    return load_encoder(registry["filterbank-dense"].model_copy(update={"input_size": 64}))


def test_filterbank_is_deterministic_and_batch_independent(small_filterbank):
    images = random_images(2, 64, seed=5)
    grid = small_filterbank.forward_tokens(images)[1]
    alone = small_filterbank.forward_tokens(images[1:])[1]
    torch.testing.assert_close(alone, grid[1:], rtol=1e-5, atol=1e-5)
    assert torch.equal(small_filterbank.forward_tokens(images[1:])[1], alone)


def test_filterbank_responds_to_stain_and_edges(small_filterbank):
    white = np.full((1, 64, 64, 3), 255, np.uint8)
    torch.testing.assert_close(small_filterbank.forward_tokens(white)[1], torch.zeros(1, 4, 4, 150), atol=1e-5, rtol=0)
    # a vertical haematoxylin-like edge at x = 32: strong |Gx|, no |Gy| (H stain, σ = 1: features 21 + 1, 21 + 2)
    edge = white.copy()
    edge[:, :, 32:] = (80, 60, 160)
    grid = small_filterbank.forward_tokens(edge)[1][0]
    at_edge = grid[1, 2]  # token column 2 ↔ px 32-47
    assert at_edge[21 + 1] > 10 * at_edge[21 + 2] + 1e-3
    assert grid[1, 0].abs().max() < 1e-4  # px 0-15, on the white side, beyond every kernel's reach
