"""Llama-family models from Hugging Face folders: config -> module -> weights.

``config`` parses ``config.json`` (no torch), ``llama`` is the forward pass, ``loader.load_model`` builds
a ready module from a folder, and ``default`` builds the bundled default model on first use. Only the
torch-free names are re-exported here, so that importing a config costs no torch import.
"""

from inference.models.config import ModelConfig, ModelLoadError, RopeScaling

__all__ = ["ModelConfig", "ModelLoadError", "RopeScaling"]
