"""Resume and takeover (protocol.md §6): credential, journal, attachment lifecycle, resume checks."""
