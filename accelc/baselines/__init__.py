"""Engines accelc is compared against, layer by layer (accelc.report)."""
