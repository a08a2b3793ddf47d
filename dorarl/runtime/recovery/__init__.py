"""Replacing dead actors mid-run: an engine instance, or the trainer from its newest
checkpoint with the calls since replayed."""
