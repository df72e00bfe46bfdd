"""``ga-report``: reads the run directories that ``ga-train`` leaves and shows a sweep at a
glance; it needs neither the engine nor the runner."""
