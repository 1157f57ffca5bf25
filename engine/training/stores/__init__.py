"""Row stores, one module per training mode (the protocol: :mod:`.base`; the modes: ../modes.py)."""
