"""Key-value stores: one protocol (:mod:`ftrun.store.base`), one module per backend, and
:func:`ftrun.store.factory.open_store` above them all."""
