"""Registering an H&E section to its Xenium section from their nuclei alone.

Two point sets, both in µm: the nuclei seen on the H&E (level-0 px × the slide's mpp) and the
Xenium nucleus centroids. ``pose`` finds the rigid pose from any start (every rotation, a mirror
flip, a translation anywhere) by FFT cross-correlation of their rasterised densities; ``blocks``
sharpens it by matching the nuclei's own patterns window by window; ``refine`` iterates a trimmed
affine on mutual nearest neighbours to convergence; ``solve`` runs the three, refuses what cannot be
registered (too few nuclei or matches, a symmetric tissue with two equally good poses) and writes
the result as 10x's alignment matrix (H&E px → morphology px). Pure maths: arrays in, arrays out.
"""
