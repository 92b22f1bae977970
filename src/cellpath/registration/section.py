"""Registering a raw section (the I/O edge of this package): its H&E's nuclei from the built-in
detector, its Xenium nuclei from cells.zarr.zip, ``solve.register_nuclei`` between them, and the
matched distances under the registered alignment and, where the folder has one, the given one (the
concordance stage's registration QC and thresholds)."""

from __future__ import annotations

import logging

import numpy as np

from cellpath.concordance.detector import detect_nuclei
from cellpath.concordance.registration import registration_qc
from cellpath.config import ConcordanceConfig
from cellpath.io.coords import read_alignment, um_to_he_px
from cellpath.io.ingest import Bundle, read_he_geometry, read_nucleus_centroids
from cellpath.registration.solve import Registration, register_nuclei

log = logging.getLogger(__name__)


def alignment_distances(detected_px: np.ndarray, xenium_um: np.ndarray, alignment: np.ndarray, mpp: float,
                        qc: ConcordanceConfig) -> dict:
    """Matched-nucleus distances (µm) of the detected nuclei against the Xenium nuclei placed on the
    H&E by ``alignment``, and the verdict against the concordance stage's registration QC."""
    result = registration_qc(detected_px, um_to_he_px(xenium_um, alignment), mpp, qc.registration_radius_um)
    flagged = result.reg_median_um > qc.registration_max_median_um or result.reg_p90_um > qc.registration_max_p90_um
    return {"matched_nuclei": result.reg_pairs, "median_um": result.reg_median_um, "p90_um": result.reg_p90_um,
            "verdict": "fails QC" if flagged or not np.isfinite(result.reg_median_um) else "passes QC"}


def register_bundle(bundle: Bundle, qc: ConcordanceConfig) -> tuple[Registration, dict]:
    """Register one located raw section; returns the registration and its record (written by the caller)."""
    mpp, _ = read_he_geometry(bundle)
    nuclei, _ = read_nucleus_centroids(bundle)
    xenium_um = nuclei[["nucleus_x_um", "nucleus_y_um"]].to_numpy(float)
    detections = detect_nuclei(bundle.he_image, mpp=mpp)
    detected_px = np.column_stack([detections.x_px, detections.y_px])
    log.info("register %s: %d nuclei detected on the H&E (mpp %.4f), %d Xenium nuclei", bundle.section_id,
             len(detected_px), mpp, len(xenium_um))
    result = register_nuclei(detected_px, mpp, xenium_um)
    record = {"section_id": bundle.section_id, "he_image": bundle.he_image.name, "he_mpp": mpp,
              "alignment_he_px_to_morphology_px": result.alignment.tolist(),
              "he_um_to_xenium_um": result.he_um_to_xenium_um.tolist(), **result.record,
              "registered": alignment_distances(detected_px, xenium_um, result.alignment, mpp, qc)}
    if bundle.he_alignment is not None:
        given, _ = read_alignment(bundle.he_alignment, bundle.section_id)
        record["given"] = {"file": bundle.he_alignment.name,
                           **alignment_distances(detected_px, xenium_um, given, mpp, qc)}
    return result, record
