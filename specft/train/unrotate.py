"""trainer.unrotate: train the draft in the target's unrotated basis, serve it folded.

A rotated target (quant/rotation.py; msModelSlim's QuaRot) computes x @ R1 where the
16-bit model computes x, so its cached aux states, final states, embedding and head are
all rotated. Trained on them as they are, the draft learns in the rotated basis, where the
residual stream's few large channels are spread over every coordinate. When R1 is known
(the quant config's rotation, the matrix the quantizer saved, or one recovered with
scripts/recover_rotation.py), the readers here un-rotate everything stage 2 reads
(x @ R1^T), so the draft trains in the basis it would on the 16-bit target, still on the
quantized target's values. The trainer (its _served) folds R1 into every draft it writes,
checkpoints and final, with export/rotation_fold.py's fold_into_eagle3, so each reads the
served, rotated states with no further step; DeepSpeed states stay in the training basis.
R1 comes from target_model/rotation_source.py's served_rotation.

Exact in float64: features, embedding and head un-rotated by R1^T are the unrotated
target's (tests/test_unrotate.py).
"""

from __future__ import annotations

import torch

from specft.cache import SourcesReader


class UnrotatedFeatures:
    """A feature reader (CacheReader, OnlineFeatures) whose hidden states, embedding and
    head rows come back multiplied by R1^T; everything else is the wrapped reader's."""

    def __init__(self, reader, r1: torch.Tensor):
        self.reader, self.r1 = reader, r1
        # R1^T once per working dtype: float64 inputs (the exactness tests) stay float64;
        # cached bf16/float32 features take a float32 matmul on every fetch, not float64.
        self._r1t = {torch.float64: r1.T.double(), torch.float32: r1.T.float()}

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def __len__(self) -> int:
        return len(self.reader)

    def _back(self, x: torch.Tensor) -> torch.Tensor:
        """x @ R1^T on each H-wide block of the last dim (aux states concatenate layers)."""
        h = self.r1.shape[0]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        blocks = x.to(work).reshape(*x.shape[:-1], x.shape[-1] // h, h)
        return (blocks @ self._r1t[work]).reshape(x.shape).to(x.dtype)

    def for_epoch(self, epoch: int):
        view = self.reader.for_epoch(epoch)
        return self if view is self.reader else UnrotatedFeatures(view, self.r1)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = dict(self.reader[i])
        for key in ("aux_hidden", "final_hidden"):
            sample[key] = self._back(sample[key])
        return sample

    def target_head(self) -> dict[str, torch.Tensor]:
        return {name: self._back(t) for name, t in self.reader.target_head().items()}

    def target_embedding(self) -> torch.Tensor:
        return self._back(self.reader.target_embedding())

    def target_head_rows(self, start: int, stop: int) -> torch.Tensor:
        return self._back(self.reader.target_head_rows(start, stop))

    def target_head_rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        return self._back(self.reader.target_head_rows_at(ids))


def unrotated(reader, r1: torch.Tensor):
    """``reader`` un-rotated; a SourcesReader keeps its type, its members wrapped."""
    if reader is None:
        return None
    if isinstance(reader, SourcesReader):
        return SourcesReader({source: UnrotatedFeatures(r, r1) for source, r in reader.readers.items()})
    return UnrotatedFeatures(reader, r1)

