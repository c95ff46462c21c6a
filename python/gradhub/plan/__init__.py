"""Planning gradhub deployments: a discrete-event simulator of gradhub and of
DDP's ring all-reduce (`gradhub simulate`), a layout/option search over it
(`gradhub plan`), machine-cost calibration (`gradhub bench calibrate`) and
its validation against the emulated cluster (`gradhub bench validate`)."""
