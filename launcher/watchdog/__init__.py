"""The stall watchdog: GPU sources, the detector and policy, the loop that bursts, replay and simulation."""
