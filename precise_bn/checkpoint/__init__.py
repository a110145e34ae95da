"""Checkpoint files: reading them without running their code, writing back atomically."""
