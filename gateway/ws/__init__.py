"""WebSocket connections: handshake, inbound mailbox, the session actor and the single writer."""
