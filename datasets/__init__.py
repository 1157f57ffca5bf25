"""Dataset formats, readers and generators."""
