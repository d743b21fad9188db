"""Tiny random stand-ins for the two voice-prompt ONNX models (model.md §6.1, §6.10), written with the
`onnx` helper API: same file names, input/output names, dtypes and ranks as the real ones, seeded weights,
byte-identical for the same seed.

| file | inputs | output | tiny graph |
| --- | --- | --- | --- |
| `speech_tokenizer_v2_25hz.onnx` | `feats` f32 [B, 128, T], `feats_length` i32 [B] | `indices` i32 [B, ceil(T/4)] | conv k4 s4 to 8 channels, tanh, round to {-1, 0, 1}: an 8-digit base-3 code in [0, 6561) (the real tokenizer's FSQ codebook) |
| `campplus.onnx` | `input` f32 [B, T, 80] | `output` f32 [B, 192] | linear 80->64, ReLU, mean over time, linear 64->192 |
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OPSET = 17
IR_VERSION = 8  # what onnxruntime has read for years; the graphs use nothing newer
TOKENIZER_MELS, FSQ_DIMS, TOKEN_STRIDE = 128, 8, 4  # 3 ** 8 = 6561 codes, 100 Hz mel -> 25 Hz
FBANK_BINS, CAM_HIDDEN, SPK_DIM = 80, 64, 192
WEIGHT_STD = 0.05
# Zero-mean conv filters of this std answer to the mel's shape, not its level (~0.6 everywhere), so the codes of
# two noise clips differ and spread over the codebook.
TOKENIZER_STD = 0.3


def _tokenizer(rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w = rng.standard_normal((FSQ_DIMS, TOKENIZER_MELS, TOKEN_STRIDE))
    w = ((w - w.mean(axis=(1, 2), keepdims=True)) * TOKENIZER_STD).astype(np.float32)
    inits = [numpy_helper.from_array(w, "conv.weight"),
             numpy_helper.from_array(np.zeros(FSQ_DIMS, np.float32), "conv.bias"),
             numpy_helper.from_array(np.ones(1, np.float32), "one"),
             numpy_helper.from_array(3.0 ** np.arange(FSQ_DIMS, dtype=np.float32), "digits")]
    nodes = [
        # pads [0, 3]: ceil(T / 4) codes, as the real tokenizer's two stride-2 convs give
        helper.make_node("Conv", ["feats", "conv.weight", "conv.bias"], ["h"], strides=[TOKEN_STRIDE],
                         kernel_shape=[TOKEN_STRIDE], pads=[0, TOKEN_STRIDE - 1]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Round", ["t"], ["r"]),
        helper.make_node("Add", ["r", "one"], ["d"]),                       # digits in {0, 1, 2}
        helper.make_node("Transpose", ["d"], ["dt"], perm=[0, 2, 1]),       # [B, T', 8]
        helper.make_node("MatMul", ["dt", "digits"], ["code"]),             # [B, T']
        helper.make_node("Cast", ["code"], ["indices"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes, "tiny_speech_tokenizer_v2_25hz",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", TOKENIZER_MELS, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "T_tok"])], inits)
    return _serialize(graph)


def _campplus(rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w1 = (rng.standard_normal((FBANK_BINS, CAM_HIDDEN)) * WEIGHT_STD).astype(np.float32)
    w2 = (rng.standard_normal((CAM_HIDDEN, SPK_DIM)) * WEIGHT_STD * 10).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "fc1.weight"), numpy_helper.from_array(w2, "fc2.weight")]
    nodes = [helper.make_node("MatMul", ["input", "fc1.weight"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("ReduceMean", ["a"], ["pooled"], axes=[1], keepdims=0),  # statistics pooling
             helper.make_node("MatMul", ["pooled", "fc2.weight"], ["output"])]
    graph = helper.make_graph(
        nodes, "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", FBANK_BINS])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", SPK_DIM])], inits)
    return _serialize(graph)


def _serialize(graph: object) -> bytes:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],  # type: ignore[arg-type]
                              producer_name="minicpmo-duplex tiny checkpoint", ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_tiny_prompt_models(asset_dir: Path, seed: int) -> None:
    """`speech_tokenizer_v2_25hz.onnx` and `campplus.onnx` into `asset_dir`, from one seeded generator."""
    from engine.token2wav.prompt import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE

    rng = np.random.default_rng(seed)
    asset_dir = Path(asset_dir)
    asset_dir.mkdir(parents=True, exist_ok=True)
    (asset_dir / SPEECH_TOKENIZER_FILE).write_bytes(_tokenizer(rng))
    (asset_dir / CAMPPLUS_FILE).write_bytes(_campplus(rng))
