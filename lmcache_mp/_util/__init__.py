"""Private leaf helpers (array conversions, private paths) that every layer
may import; they import nothing of lmcache_mp's.
"""
