"""Key-value stores: one protocol (:mod:`ftrun.store.base`), one module per backend."""

from ftrun.store.base import EventType, KeyValue, Store, Watch, WatchEvent, open_store

__all__ = ["EventType", "KeyValue", "Store", "Watch", "WatchEvent", "open_store"]
