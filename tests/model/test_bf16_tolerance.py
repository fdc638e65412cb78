"""bfloat16 against the fp32 reference on the real SmolLM2 (teacher_forcing.py).

Measured on 2 AVX512-BF16 cores (torch 2.13): top-1 agreement 0.975 (156/160), mean
|logprob error| of the fp32 greedy token 0.022, max 0.27. The bounds below leave room for
other CPUs' kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.teacher_forcing import Reference, agreement
from workers.scheduler.engine.model_runner import TorchModelRunner

pytestmark = pytest.mark.model

MIN_TOP1_AGREEMENT = 0.9
MAX_MEAN_LOGPROB_ERROR = 0.06


def test_bf16_follows_the_fp32_greedy_trajectory(model_path: str, reference: Reference) -> None:
    bf16 = TorchModelRunner.load(model_path, 64, 16, dtype="bfloat16")
    assert bf16.kv_cache[0][0].dtype == torch.bfloat16
    result = agreement(reference, bf16)
    assert result.top1 / result.total >= MIN_TOP1_AGREEMENT, str(result)
    assert result.mean_error <= MAX_MEAN_LOGPROB_ERROR, str(result)
