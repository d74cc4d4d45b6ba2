"""Generating and scoring samples: prompt files and data sources, the generate loop and helpers, rewards."""
