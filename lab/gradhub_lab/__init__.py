"""gradhub's lab: the measurement harness behind the figures in docs/, kept
apart from the product (it depends on gradhub; gradhub never imports it).

An emulated cluster on one machine (network namespaces, veth, tc; root),
emulated training with the built-in models' profiles against DDP and the
BytePS optimum, the benchmark suite and its report (docs/bench/), the fault
campaigns, multi-tenancy, the simulator's validation against emulation and
the emulated cluster's own costs. Entry point: `gradhub-lab ...` (or
`python -m gradhub_lab ...`); run from the source checkout, whose docs/ its
defaults write into."""
