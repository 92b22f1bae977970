"""CellPath-Bench + CRoMa: single-cell evaluation of frozen pathology foundation models."""

import os

# MKL's strict conditional numerical reproducibility: torch's CPU matrix products (MKL on x86) give
# the same bits on one thread or many. Without it, MKL splits a product's sum across threads on some
# CPUs (an Intel Xeon with AVX-512 and AMX did), and a probe's weights moved with the thread count
# (docs/decisions/0050). MKL reads it when it starts: set here, before anything imports torch, and
# inherited by every worker process. AUTO keeps the CPU's own code path.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
