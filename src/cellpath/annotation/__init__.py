"""Reference-guided label transfer: each cell one of the 68 molecular types, mapped to the fine and coarse taxonomies."""
