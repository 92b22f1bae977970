"""scRNA-seq references for label transfer: the manifest of the paper's 14 references
(``data/manifests/references.csv``) and the builders that turn each public download into the
``data/references/<name>.h5ad`` the annotate stage reads (``cellpath references build``)."""
