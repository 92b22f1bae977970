import numpy as np
import pytest

from cellpath.errors import InputError
from cellpath.features.store import artifact_dir, expected_sidecar, is_complete, read_artifact, write_artifact

IDS = np.array(["c1", "c2", "c3"])


def _expected(**changes):
    base = dict(encoder="random-vit-s16", revision="seed0", magnification="20x", target_mpp=0.5,
                tiling={"input_size": 224, "patch_px": 409.2}, code_version="1", cell_ids=IDS)
    return expected_sidecar(**(base | changes))


def _readouts(rng):
    return {"Nuc": rng.normal(size=(3, 8)), "Mean": rng.normal(size=(3, 8)), "Cls": rng.normal(size=(3, 8))}


def test_round_trip_is_float16_on_disk_and_float32_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    folder = artifact_dir(tmp_path, "random-vit-s16", "20x", "s1")
    data = _readouts(rng)
    write_artifact(folder, data, _expected())
    assert np.load(folder / "Nuc.npy").dtype == np.float16
    loaded = read_artifact(folder, _expected())
    assert set(loaded) == {"Nuc", "Mean", "Cls"}
    assert loaded["Nuc"].dtype == np.float32
    np.testing.assert_allclose(loaded["Mean"], data["Mean"], rtol=1e-3, atol=1e-3)
    assert is_complete(folder, _expected())


@pytest.mark.parametrize(("change", "field"), [
    ({"revision": "abc123"}, "revision"),
    ({"encoder": "other"}, "encoder"),
    ({"cell_ids": np.array(["c1", "c3", "c2"])}, "cell_order_sha256"),
    ({"tiling": {"input_size": 256, "patch_px": 467.5}}, "tiling"),
])
def test_stale_or_foreign_sidecar_is_rejected(tmp_path, change, field):
    folder = tmp_path / "a"
    write_artifact(folder, _readouts(np.random.default_rng(1)), _expected())
    assert not is_complete(folder, _expected(**change))
    with pytest.raises(InputError, match=f"stale feature artifact: {field} is"):
        read_artifact(folder, _expected(**change))


def test_nan_features_are_refused_with_a_count(tmp_path):
    data = _readouts(np.random.default_rng(2))
    data["Nuc"][1, 3] = np.nan
    with pytest.raises(ValueError, match="Nuc: 1 cells have NaN"):
        write_artifact(tmp_path / "a", data, _expected())
    assert not (tmp_path / "a").exists()
    assert list(tmp_path.iterdir()) == []


def test_crash_half_way_leaves_no_partial_artifact(tmp_path, monkeypatch):
    import cellpath.features.store as store

    calls = {"n": 0}
    real_save = np.save

    def failing_save(path, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real_save(path, array)

    monkeypatch.setattr(store.np, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        write_artifact(tmp_path / "a", _readouts(np.random.default_rng(3)), _expected())
    assert list(tmp_path.iterdir()) == []
    assert not is_complete(tmp_path / "a", _expected())


def test_missing_artifact_names_the_folder(tmp_path):
    with pytest.raises(InputError, match="run `cellpath extract`"):
        read_artifact(tmp_path / "nothing")
