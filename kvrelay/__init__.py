"""kvrelay's Python API: ``from kvrelay import LLM, SamplingParams`` (see `kvrelay.llm`).

The servers are the ``kvrelay`` command (`deploy.cli`); the packages beside this one are the system.
"""

from kvrelay.llm import LLM, CompletionOutput, RequestOutput
from kvrelay.sampling_params import SamplingParams
from model.structured import StructuredOutput, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutput", "StructuredOutputsParams"]
