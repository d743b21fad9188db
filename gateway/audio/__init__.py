"""Audio codecs for the wire formats of protocol.md §9 (decoding, resampling, encoding)."""
