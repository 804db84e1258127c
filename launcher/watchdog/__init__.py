"""The stall watchdog: the detector and policy, the loop that bursts, replay and simulation
(its GPU and trainer-log signals: launcher/signals)."""
