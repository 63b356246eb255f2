"""dflash_offline: offline, two-stage training of DFlash speculative-decoding drafters for Qwen targets."""

import logging as _logging

__version__ = "0.1.0"


class _ImportNotes(_logging.Filter):
    """Drops two notes printed whenever transformers imports torchao (installed for precision=fp8) while loading any
    model: the compiled extensions this machine cannot load (CUDA-only or other-architecture kernels; float8
    training does not use them) and torch's deprecation of torchao's pytree registrations. Anything else passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load ") and "torchao" in msg) and \
            "natively supported by torch.compile as an opaque value type" not in msg


for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).addFilter(_ImportNotes())
