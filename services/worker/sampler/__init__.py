"""The sampler: logits of the batch's sampling rows -> next tokens (+ logprobs).

It consumes `SamplingMetadata` and imports nothing else of the worker; the worker builds the
metadata from its persistent batch (services/worker/sampling_metadata.py).
"""

from services.worker.sampler.metadata import SamplingMetadata
from services.worker.sampler.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
