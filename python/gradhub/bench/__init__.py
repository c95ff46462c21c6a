"""The benchmark suite: an emulated cluster on one machine (network namespaces,
veth, tc), emulated training with real model profiles, and push_pull goodput
against the BytePS optimum. Entry point: `gradhub bench ...`."""
