"""Cost model, pipeline simulator, split search, calibration and the planner: what a run
would cost, above the schedules they price."""
