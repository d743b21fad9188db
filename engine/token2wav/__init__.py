"""Token2Wav: flow matching (conformer encoder + DiT CFM) and the HiFT vocoder, streamed per session
(model.md §1.6, §1.7, §6). See `stream.py` for the per-session state and `assets.py` for loading."""
