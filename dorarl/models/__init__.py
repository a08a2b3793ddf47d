"""Real pretrained models: a registry of known ones, fetching, GGUF conversion and checks.

`dorarl model get NAME --out DIR` fetches a known model and converts it; `dorarl model
convert FILE.gguf --out DIR` converts a user's own GGUF. Both write a Hugging Face folder
(config.json, model.safetensors, tokenizer, chat template, generation_config.json) that
the engine, the trainer and transformers load, and check the engine against transformers.
"""
