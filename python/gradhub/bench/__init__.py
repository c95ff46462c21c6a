"""gradhub's benchmarks for your own machines (`gradhub bench ...`): the data
plane on loopback, many small tensors, this machine's costs for the
simulator, the GPU check, timeline pictures. The emulated-cluster harness
behind docs/ is the lab (lab/ in the source checkout, `gradhub-lab`)."""
