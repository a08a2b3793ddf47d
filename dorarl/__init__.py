"""dorarl: asynchronous RL for LLM post-training with multi-version streaming rollout."""

__version__ = "0.1.0"
