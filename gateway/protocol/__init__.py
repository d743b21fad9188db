"""Wire protocol of protocol.md: typed client/server events, error codes, profiles, session config."""
