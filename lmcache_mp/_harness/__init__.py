"""What ``lmcache-mp bench`` and ``lmcache-mp eval`` share: the reference
documents and passkeys, agreement scoring, the progress line and the
command-line option types."""
