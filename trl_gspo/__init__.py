"""GSPO and GSPO-token for TRL: `GSPOConfig` / `GSPOTrainer` are drop-in subclasses of TRL's GRPO classes."""

from .config import GSPOConfig
from .trainer import GSPOTrainer

__all__ = ["GSPOConfig", "GSPOTrainer"]
__version__ = "0.1.0"
