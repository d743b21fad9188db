"""Gateway <-> runtime boundary: the `Runtime` protocol and its Triton implementation."""
