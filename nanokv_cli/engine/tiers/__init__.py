"""Second-level KV cache tiers (issue 46): where blocks evicted from the device cache go.

``spec``: the ``disk:PATH:SIZE`` / ``host:SIZE`` settings. ``fingerprint``: what a block's
K/V depends on besides its tokens. ``base``: the Tier API and its errors. ``host``: an LRU of
CPU copies. ``disk``: fixed-size slots in one file per fingerprint inside PATH, kept across
restarts (format in ``layout``). ``factory.open_tier`` opens the one a spec names.
"""
