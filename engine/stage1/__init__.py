"""Stage1 ("talker"): the TTS speech-token engine (model.md §5)."""
