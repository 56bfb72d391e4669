"""GSPO and GSPO-token for TRL: `GSPOConfig` / `GSPOTrainer` are drop-in subclasses of TRL's GRPO classes."""

from .common.trl_compat import check_trl_version

check_trl_version()  # before importing TRL's trainer: a TRL outside the tested range gets a clear message

from .config import GSPOConfig  # noqa: E402
from .trainer import GSPOTrainer  # noqa: E402

__all__ = ["GSPOConfig", "GSPOTrainer"]
__version__ = "0.1.0"
