"""HDF5 gradient dumps: the work behind the ``ccoll`` command (ccoll/cli.py parses arguments).

- :mod:`ccoll.h5.compress` / :mod:`ccoll.h5.decompress`: whole files, all or nothing
- :mod:`ccoll.h5.inspect`: sizes, ratios and bounds per dataset
- :mod:`ccoll.h5.evaluate` (with :mod:`ccoll.h5.peers`, :mod:`ccoll.h5.plot`): ccoll vs SZ3/ZFP
- :mod:`ccoll.h5.attrs`: the ``ccoll_*`` attributes that make a compressed file self-describing
- :mod:`ccoll.h5.tree`, :mod:`ccoll.h5.output`, :mod:`ccoll.h5.zstdframe`,
  :mod:`ccoll.h5.progress`: walking and selecting, safe output files, the zstd stage, progress
"""
