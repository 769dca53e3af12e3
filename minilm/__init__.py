"""minilm: MiniMind-class language models, pretrained with Ray. The library is pure PyTorch."""

from .checkpoint import load_pretrained
from .config import ConfigError, ModelConfig, TrainConfig
from .model import MiniMindForCausalLM

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "MiniMindForCausalLM", "load_pretrained"]
__version__ = "0.1.0"
