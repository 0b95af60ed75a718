"""The decision layer: what every call's plan is made from, and the plan itself.

- :mod:`~ccoll.collectives.policy.calibration`: the cost model's constants, obtained once
  when a Communicator is made (settings, cache, probe or defaults);
- :mod:`~ccoll.collectives.policy.plan`: one plan per call, from the agreed signature, the
  calibration and the times earlier calls of the signature agreed on;
- :mod:`~ccoll.collectives.policy.probes`: link probe, the ring's fixed costs, MPI's own
  share of the link;
- :mod:`~ccoll.collectives.policy.fits`: compressor rates, ratio sampling;
- :mod:`~ccoll.collectives.policy.cache`: the calibration cache file.

None of them imports the Communicator.
"""
