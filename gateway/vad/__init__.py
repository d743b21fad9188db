"""Server VAD (silero on onnxruntime, no torch) and overlap policies (protocol.md §8)."""
