"""The vLLM backend: `VllmEngine` answers the calls a rollout instance makes of `Engine`
on vLLM's engine; importing this package does not import vllm (engine.py does)."""
