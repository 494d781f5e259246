"""``leyline eval memory``: where to put a user profile, early or late, and what it costs."""
