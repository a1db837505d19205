from minisgl.models.config import ModelConfig
from minisgl.models.register import get_model_class
from minisgl.models.weight import (
    default_model,
    init_dummy_weights,
    load_weights,
    resolve_model_path,
)

__all__ = [
    "ModelConfig",
    "default_model",
    "get_model_class",
    "init_dummy_weights",
    "load_weights",
    "resolve_model_path",
]
