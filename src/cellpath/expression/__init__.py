"""Label-free expression probes: how much of each cell's measured expression the features decode."""
