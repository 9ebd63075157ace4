"""The stream core, private: what every stream is, the data that crosses to a
worker, how a phase's outcomes are committed and reported.

Nothing here is public API: ``stream``, ``request``, ``batch`` and
``metrics`` re-export what users need.
"""
