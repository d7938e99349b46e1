"""A simulated GPU: the engine's real scheduler, KV manager, adapter pool, tiers and loader
threads on a simulated clock, with no kernels run (``devices.SimulatedDevice``).

Every figure it produces is simulated and is labelled with the device profile it used
(``profile.py``) and that profile's calibration error.
"""
