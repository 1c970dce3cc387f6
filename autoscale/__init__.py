"""Batch limits that move at runtime, only inside a measured safe range: calibration profiles
(`profile`), the knee finder (`knee`), the sweep (`calibrate`), the pure policy (`policy`) and
the controller that applies it (`controller`), with its config (`config`)."""
