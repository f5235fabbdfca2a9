"""Suite-wide settings."""
from __future__ import annotations

import os

import torch
from hypothesis import settings

# The tiny test models are far too small for intra-op parallelism to pay: one thread avoids
# thread hand-off on every kernel and keeps the suite fast on a 2-core CI machine.
torch.set_num_threads(1)

# Property tests draw the same examples on every run, so CI's verdict on a commit is the one seen
# before committing; HYPOTHESIS_PROFILE=explore draws fresh ones (run it before changing the
# properties or the code under them).
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
