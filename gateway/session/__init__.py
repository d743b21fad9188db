"""The `DuplexSession` aggregate root and its private ledgers."""
