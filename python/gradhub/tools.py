"""What tools beside the package use: the lab (lab/gradhub_lab), which
measures and attacks the product from outside, and the tests. One
documented internal module, so that they need none of the package's
private ones (`_core`, `_ports`, `_env`). Not part of the user's API: names
here may change with the package.

- `free_port(host)`: a port free now, outside the ephemeral range, never
  handed out twice by this process (for a scheduler or server started next);
- `job_token(master, job)`: job `job`'s token under a shared service's
  master token (what `gradhub token JOB` prints);
- `encode_frame(msg_type, payload, ...)`: one frame as the wire carries it,
  checksums filled in (to talk to members byte by byte, hostile or not);
- `setting(name)`: a `GRADHUB_*` setting's value from the environment, as
  the package reads it (its registry's type and default);
- `DEFAULT_FUSION_THRESHOLD`: the fusion buffer's default size in bytes;
- `set_server_optimizer(name, numel, kind, lr, ...)`: the servers run an
  optimizer on a named tensor's chunks (what the torch layer's
  `optimizer_on_server` mode builds on), for jobs on numpy arrays.
"""

from __future__ import annotations

from ._core import encode_frame, job_token
from ._env import DEFAULT_FUSION_THRESHOLD
from ._env import get as setting
from ._ports import free_port
from .api import set_server_optimizer

__all__ = ["DEFAULT_FUSION_THRESHOLD", "encode_frame", "free_port", "job_token", "set_server_optimizer", "setting"]
