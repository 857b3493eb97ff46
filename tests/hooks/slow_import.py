"""A module whose import takes 1.5 s: in the fork server's preload list it stands for a slow host, where
importing the media modules holds up the first fork."""

import time

time.sleep(1.5)
