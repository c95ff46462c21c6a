"""Planning gradhub deployments: a discrete-event simulator of gradhub and of
DDP's all-reduce (`gradhub simulate`), a layout/option search over it
(`gradhub plan`), the built-in models, the closed forms it is checked
against (theory.py) and the machine costs it charges (costs.py; measured by
`gradhub bench calibrate`). Its validation against the emulated cluster is
the lab's (`gradhub-lab validate`)."""
