"""Suite-wide settings."""
from __future__ import annotations

import torch

# The tiny test models are far too small for intra-op parallelism to pay: one thread avoids
# thread hand-off on every kernel and keeps the suite fast on a 2-core CI machine.
torch.set_num_threads(1)
