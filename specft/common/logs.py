"""Console logging for every entry point (the CLI and each DeepSpeed rank)."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int = 0) -> None:
    """Rank 0 logs progress; other ranks only warnings, so N ranks print one story."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[specft %(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Hydra's job logging config disables loggers that exist before it runs (modules
    # imported while validating): turn ours back on.
    for name, logger in logging.root.manager.loggerDict.items():
        if name.startswith("specft") and isinstance(logger, logging.Logger):
            logger.disabled = False
