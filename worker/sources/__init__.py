"""Issues in, pull requests out: issue trackers as the fleet's source of work (README "Taking work
from GitHub"). :mod:`.tracker` is the interface, :mod:`.github` the one tracker built,
:mod:`.items` what an item becomes, :mod:`.writeback` what is posted back, :mod:`.passes` a pass."""
