"""minilm: MiniMind-class language models, pretrained with Ray. Names are imported on first use, so that
`import minilm.data` (a Ray Data reader, the prepare driver) does not pay for torch."""

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "MiniMindForCausalLM", "load_pretrained"]
__version__ = "0.1.0"

_WHERE = {"ConfigError": "config", "ModelConfig": "config", "TrainConfig": "config", "MiniMindForCausalLM": "model",
          "load_pretrained": "checkpoint"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'minilm' has no attribute {name!r}")
