"""What every layer shares: the CPU/GPU seam, memory, HTTP, plugins, metrics, checkpoint layout."""
