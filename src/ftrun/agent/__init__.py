"""The per-node agent: starts, watches, stops and restarts the local workers."""
