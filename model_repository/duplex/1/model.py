"""Triton model `duplex`: the per-session pipeline stage0 -> tts -> token2wav (decoupled BLS).

All behaviour lives in model_repository/common/pipeline.py. Why BLS and not an ensemble:
docs/triton.md, "Why the pipeline is BLS".
"""

from model_repository.common.pipeline import PipelineModel


class TritonPythonModel(PipelineModel):
    pass
