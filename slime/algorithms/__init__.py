"""RL maths in pure torch: advantages (incl. GAE), losses, KL, importance sampling/mismatch, aggregation."""
