"""Support for every layer: atomic files (fsutil.py), captured library output (capture.py), argument checks
(validate.py) and limits checked before anything is allocated (limits.py). Standard library only."""
