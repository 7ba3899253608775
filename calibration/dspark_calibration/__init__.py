"""Confidence calibration (Sequential Temperature Scaling) and hardware-curve profiling; numpy only."""
