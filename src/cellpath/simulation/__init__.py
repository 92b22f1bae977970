"""The seeded simulator of the default panel: tissue, expression, morphology, the rendered H&E and the Xenium bundle."""
