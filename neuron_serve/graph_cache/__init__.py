"""Persistent compiled-graph cache: keys (key.py), storage (store.py), background
compilation (background.py)."""
