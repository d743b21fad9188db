"""Triton model `token2wav`: a decoupled, sequence-keyed adapter over its engine.

All behaviour lives in model_repository/common/adapter.py; which engine runs is the
`engine_factory` parameter of config.pbtxt (set from the deploy profile by build/).
"""

from model_repository.common.adapter import DecoupledStageModel


class TritonPythonModel(DecoupledStageModel):
    pass
