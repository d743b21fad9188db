"""The Realtime load generator behind `bench/load_realtime.py` (issue 13): simulated users over real WebSockets."""
