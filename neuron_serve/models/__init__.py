"""Model assets: the embedded demo model and offline builders of tiny test checkpoints."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"
