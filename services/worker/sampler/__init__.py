"""The sampler: logits of the batch's sampling rows -> next tokens (+ logprobs)."""

from services.worker.sampler.builder import build_sampling_metadata
from services.worker.sampler.metadata import SamplingMetadata
from services.worker.sampler.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "build_sampling_metadata"]
