"""CellViT++ concordance: nuclei detected on the H&E against Xenium's, registration QC and the nested panels."""
