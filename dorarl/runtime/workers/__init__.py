"""The actors' classes: rollout instances, the trainer (one process or a group of ranks) and
the evaluator, each a plain class a Ray actor wraps thinly."""
