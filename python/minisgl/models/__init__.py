"""The models: `config.ModelConfig`, the decoder of every architecture (`llama`), `weight`, `hf`."""
