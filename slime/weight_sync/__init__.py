"""Trainer weights to the engines: distributed broadcast, in-place tensors (colocated), disk snapshots."""
