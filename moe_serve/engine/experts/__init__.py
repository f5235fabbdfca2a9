"""Where routed experts live and move: pinned CPU store -> PCIe copies -> GPU expert slots."""
