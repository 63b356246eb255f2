"""dflash_offline: offline, two-stage training of DFlash speculative-decoding drafters for Qwen targets."""

__version__ = "0.1.0"
